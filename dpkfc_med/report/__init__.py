"""Audit-ready privacy report: versioned JSON schema, Markdown/HTML rendering and plots."""
