"""The API server's routes, one module per group; `build_app` (server/app.py) mounts them."""
