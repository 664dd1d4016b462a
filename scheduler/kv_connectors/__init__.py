"""The scheduler side of KV movement between engines: one ``KvPolicy`` per mover (what to
export, import or look up for each plan), found through ``registry``, and the imports
waiting for their request's first chunk (``pending_imports``)."""
