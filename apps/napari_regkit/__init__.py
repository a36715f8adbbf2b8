"""napari plugin for regkit (reader, writer, registration and inspection widgets)."""
