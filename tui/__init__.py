"""The mlxtoy terminal UI (Textual). Start it with `mlxtoy tui`; see tui/app.py."""
