"""Information flow routes (Ferrando & Voita 2024): how much each part of every residual update
contributes to the whole, from one forward pass, and the route a prediction takes through them
(definitions: docs/routes.md). The front door is ``attnflow.routes(model, text, ...)``
(`attnflow.flow_routes.api.routes`), which returns a `Routes`.

Modules: ``forward`` (the one forward pass, its hooks and the weights read), ``contributions``
(parts, proximities, the compiled kernel), ``graph`` (extraction, importance), ``lens`` (the logit
lens, direct effects), ``api`` (the front door), ``result`` (`Routes`, ``routes.json``; its page
and figure come from attnflow.viz, connected by the package root). Over a dataset (``attnflow
routes --file / --data``): ``dataset`` (its step and job on the run engine, the summary),
``head_roles`` (what a head does, measured from its attention), its page ``attnflow.viz.routes_data``.
"""
