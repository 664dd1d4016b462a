"""OpenAI's Responses API (``/v1/responses``) on the chat pipeline.

translate: the request and its conversation as a chat request; builder: one sequence's
deltas as output items and stream events; store: one frontend's bounded store of
results; peers: finding a stored result from any frontend; routes: the HTTP handlers.
"""
