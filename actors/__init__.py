"""Hosts of many virtual clients: the in-process host and its Ray actor wrapper."""
