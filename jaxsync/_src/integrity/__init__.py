"""Telling hardware faults from numerical ones: replicas compared bit for bit."""
