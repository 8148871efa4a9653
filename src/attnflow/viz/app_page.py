"""The page of `attnflow serve`: type a text, pick a model and methods, see the explanation.

One document (``viz/assets/app.html``, ``app.css``, ``app.js``) that talks to the JSON API on its own
origin only (Content-Security-Policy ``connect-src 'self'``; its one script allowed by hash). Token
strings reach the DOM as text nodes, never as HTML.
"""

from __future__ import annotations

from functools import lru_cache

from attnflow.viz.explorer import asset, content_security_policy


@lru_cache(maxsize=1)
def app_page() -> str:
    """The complete page (the same for every request: the data comes from the API)."""
    script = asset("app.js")
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>attnflow serve</title>\n<style>{asset('app.css')}</style>\n</head>\n<body>\n"
        f"{asset('app.html')}\n<script>{script}</script>\n</body>\n</html>\n"
    )


def app_page_headers() -> dict[str, str]:
    """The page's Content-Security-Policy: its own script, its own API, downloads from its own origin."""
    policy = content_security_policy(asset("app.js"))
    policy = policy.replace("default-src 'none';", "default-src 'none'; connect-src 'self';")
    return {"Content-Security-Policy": policy.replace("img-src data:", "img-src 'self' data:")}
