"""A checkpoint's tokenizer and chat templates, read the same way by every role that needs
them: the tokenizer worker renders and tokenizes with them, the gpu_worker builds the
grammar engine's view of the vocabulary, the frontend and the launcher read a template's
source (tool-call parser detection, the ``--chat-template`` check). Only ``tokenizers``,
``jinja2`` and ``llguidance`` here; no role's state.
"""
