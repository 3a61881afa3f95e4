"""The one engine shared by every adapter: snapshot → persist → commit → prune, and load."""
