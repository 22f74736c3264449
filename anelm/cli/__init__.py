"""`anelm ...`: one module per subcommand (`main.py` dispatches), each a `build_parser` and a
`run`; errors print as one `anelm: error: ...` line. The top of the import order: it may use
every other package."""
