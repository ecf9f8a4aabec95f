"""Widgets of the chat app, one concept per module."""
