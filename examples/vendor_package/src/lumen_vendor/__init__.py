"""lumen-vendor: a ledgerflow adapter for Lumen Render, an invented image vendor (the plugin example)."""
