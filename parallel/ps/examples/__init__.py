"""Data sets and models for the parameter-server examples, independent of the transport."""
