"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) on the chat
pipeline.

translate: the request as a chat request (system, blocks, tools, thinking); builder: one
sequence's deltas as content blocks and Anthropic's stream events; errors: Anthropic's
error shape; routes: the HTTP handlers.
"""
