"""The read-only web dashboard a node serves on request (``--http``).

``views`` gathers what a node knows of its run (``RunView``), ``queries`` holds every ledger
read (read-only SQLite), ``app`` is the Starlette app (page, static files, ``/api/v1/``, live
stream), ``serve`` runs it on Hypercorn's trio worker inside the node's nursery.
``docs/dashboard.md`` documents the API.
"""
