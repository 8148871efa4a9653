"""attnflow: how information flows through a transformer's attention.

Quick start::

    import attnflow
    model = attnflow.load("minilm")                       # embedded all-MiniLM-L6-v2
    trace = model.trace("The movie was terrible, but the acting was great.")[0]
    R = attnflow.rollout(trace.attentions)                # [query, key], rows sum to 1
    explanation = attnflow.explain(trace, method="rollout", row="mean")
    explanation.save("out/")

    classifier = attnflow.load("minilm-sentiment")         # minilm + a trained sentiment head
    classifier.explain("The movie was terrible, but the acting was great.", method="alti").top(3)
"""

from attnflow.lazy import lazy_attributes
from attnflow.methods import (
    alti,
    attention_flow,
    available_methods,
    context_similarity,
    encoder_decoder_rollout,
    get_method,
    grad_rollout,
    grad_x_input,
    gradient,
    norm,
    norm_rollout,
    random,
    raw_attention,
    rollout,
    saliency_row,
    to_patch_grid,
)
from attnflow.methods.registry import load_plugins
from attnflow.trace import Trace

load_plugins()  # methods other packages declare (entry-point group "attnflow.methods")


def _connect_views() -> None:
    """Give `Explanation` its views (`to_html`, `_repr_html_`, `plot`, `overlay`) from attnflow.viz,
    `AttentionModel.explain` its ``method="auto"`` (from attnflow.evaluate), and `Comparison` and
    `Exploration` theirs (`to_html`, `_repr_html_`; the explorer also its
    per-input faithfulness, from attnflow.evaluate).

    The views read Explanations and the Explanation imports no view; this root of the package
    knows both and connects them. The view modules (matplotlib) are imported on first use only.
    """
    from attnflow.explanation import _VIEWS

    def html(explanation):
        from attnflow.viz.html import explanation_html

        return explanation_html(explanation)

    def fragment(explanation, said_above=()):
        from attnflow.viz.html import explanation_fragment

        return explanation_fragment(explanation, said_above=said_above)

    def figure(explanation):
        from attnflow.viz.plot import plot_explanation

        return plot_explanation(explanation)

    def overlay(image_path, patch_scores, box=None):
        from attnflow.viz.plot import overlay_image

        return overlay_image(image_path, patch_scores, box=box)

    _VIEWS.update(html=html, fragment=fragment, figure=figure, overlay=overlay)

    from attnflow.explanation import _AUTO

    def auto_plan(model, methods, options, target):
        from attnflow.evaluate.per_input import plan_methods

        return plan_methods(model, methods, options, target)

    def auto_explain(model, trace, plan, row):
        from attnflow.evaluate.per_input import explain_planned

        return explain_planned(model, trace, plan, row)

    _AUTO.update(plan=auto_plan, explain=auto_explain)
    _connect_page_views()


def _connect_page_views() -> None:
    """`Comparison`, `Exploration` and `Routes` get their pages (and the explorer its per-input
    faithfulness) from attnflow.viz and attnflow.evaluate, imported on first use."""
    from attnflow import comparison, exploration

    def comparison_page(compared):
        from attnflow.viz.compare import model_comparison_html

        return model_comparison_html(compared)

    def comparison_fragment(compared):
        from attnflow.viz.compare import model_comparison_fragment

        return model_comparison_fragment(compared)

    def explorer_page(explored):
        from attnflow.viz.explorer import explorer_html

        return explorer_html(explored)

    def explorer_fragment(explored):
        from attnflow.viz.explorer import explorer_iframe

        return explorer_iframe(explored)

    def explorer_faithfulness(model, explored, **options):
        from attnflow.evaluate.per_input import add_view_faithfulness

        add_view_faithfulness(model, explored, **options)

    from attnflow.flow_routes import result as routes_result

    def routes_page(found):
        from attnflow.viz.routes import routes_html

        return routes_html(found)

    def routes_figure(found):
        from attnflow.viz.routes import routes_png

        return routes_png(found)

    def routes_data_page(summary):
        from attnflow.viz.routes_data import report_html

        return report_html(summary)

    routes_result._VIEWS.update(html=routes_page, png=routes_figure, data_html=routes_data_page)

    from attnflow.question import result as why_result

    def why_page(data):
        from attnflow.viz.why import why_html

        return why_html(data)

    def why_figure(data):
        from attnflow.viz.why import why_png

        return why_png(data)

    why_result._VIEWS.update(html=why_page, png=why_figure)
    _connect_notebook_views()
    comparison._VIEWS.update(html=comparison_page, fragment=comparison_fragment)
    exploration._VIEWS.update(html=explorer_page, fragment=explorer_fragment)
    exploration._MEASURES.update(faithfulness=explorer_faithfulness)


def _connect_notebook_views() -> None:
    """The notebook summaries (`_repr_html_`) of a `Trace`, `Routes` and a run's results, from
    attnflow.viz.notebook, imported on first use."""
    from attnflow import notebook

    def view(name):
        def show(result):
            from attnflow.viz import notebook as views

            return getattr(views, f"{name}_fragment")(result)

        return show

    notebook._VIEWS.update({name: view(name) for name in ("trace", "routes", "results")})


_connect_views()


# Heavy parts (torch models, plotting) load on first use so `import attnflow` stays fast: each lazy
# attribute and the module that holds it.
_LAZY = {
    "load": "attnflow.model",
    "AttentionModel": "attnflow.model",
    "audit": "attnflow.dataset_audit.engine",
    "Explanation": "attnflow.explanation",
    "explain": "attnflow.explanation",
    "Exploration": "attnflow.exploration",
    "explore": "attnflow.exploration",
    "Comparison": "attnflow.comparison",
    "compare": "attnflow.comparison",
    "patch": "attnflow.causal",
    "PatchResult": "attnflow.causal",
    "Routes": "attnflow.flow_routes.result",
    "routes": "attnflow.flow_routes.api",
    "why": "attnflow.question.run",
    "Why": "attnflow.question.result",
    "GenerationExplanation": "attnflow.generation",
    "explain_generation": "attnflow.generation",
    "GenerationExploration": "attnflow.generation_exploration",
    "explore_generation": "attnflow.generation_exploration",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "AttentionModel",
    "Comparison",
    "Explanation",
    "Exploration",
    "GenerationExplanation",
    "GenerationExploration",
    "PatchResult",
    "Routes",
    "Trace",
    "Why",
    "alti",
    "attention_flow",
    "audit",
    "available_methods",
    "compare",
    "context_similarity",
    "encoder_decoder_rollout",
    "explain",
    "explain_generation",
    "explore",
    "explore_generation",
    "get_method",
    "grad_rollout",
    "grad_x_input",
    "gradient",
    "load",
    "norm",
    "norm_rollout",
    "patch",
    "random",
    "raw_attention",
    "rollout",
    "routes",
    "saliency_row",
    "to_patch_grid",
    "why",
]
