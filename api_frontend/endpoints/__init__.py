"""The request endpoints, one folder each: its routes, its translation onto the shared
generation pipeline, its response assembly and its slice of the field table."""
