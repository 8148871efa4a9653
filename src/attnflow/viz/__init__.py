"""Views of attnflow results: self-contained HTML pages and headless matplotlib figures.

`page`: page scaffold, escaping and base64 figure embedding shared by every HTML output;
`html`: an Explanation as HTML; `plot`: matplotlib figures (Agg-safe, no pyplot).
"""
