"""The gpu_worker side of KV movement between engines: one ``KvConnector`` per mover (the P/D
transfer, the shared KV store client), found through ``registry``; the worker loop calls
them without knowing which."""
