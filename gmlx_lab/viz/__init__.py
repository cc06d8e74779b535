"""Figures for the notebooks: plotly builders, quantization helpers, cache sizes and published figures.

Importing this module inside a Jupyter kernel whose plotly renderer is the plain
`plotly_mimetype` displays plotly.js once, in the importing cell's output, and
draws each figure as the mimetype (JupyterLab, offline) plus HTML that uses that
one copy (an HTML export; never the CDN): `plotlyjs.py`. A renderer you chose, in code or with the
PLOTLY_RENDERER environment variable, is kept (gmlx_lab.book's runs keep figures as JSON and ship plotly.js
once per site).
"""

import os

from ..cache.kvarn.records import record_bytes
from ..measure.sizes import LayerShape, layer_bytes, layer_shapes, policy_bytes
from . import plotlyjs
from .capacity_figures import capacity_figure
from .code import Source, source
from .diagrams import DRAWN_IDEAS, NO_DIAGRAM, fused_step_figure, kv_growth_figure, record_layout_figure, storage_figure
from .example import EXAMPLE_MODEL, EXAMPLE_TOKENS, RunningExample, example_model, running_example
from .field_figures import SchemeIdea, field_kl_figure, field_passkey_figure, idea_figure, scheme_idea
from .figures import (
    REGION_COLORS,
    Table,
    affine_row_figure,
    bars_figure,
    butterfly_figure,
    butterfly_slider,
    bytes_label,
    channel_figure,
    code_histogram,
    draft_figure,
    error_figure,
    experiment_data,
    group_error_figure,
    growth_figure,
    imbalance_figure,
    kernel_times_figure,
    kl_strip,
    layer_kind_figure,
    normalize_slider,
    normalize_toy_figure,
    passkey_heatmaps,
    policy_strip,
    position_kl_figure,
    record_figure,
    regions_bar,
    regions_slider,
    regions_stream,
    sink_layers_figure,
    sink_mass_figure,
    slider_figure,
    stall_figure,
    stall_shares,
    table_html,
    weights_kv_figure,
    weights_kv_positions,
    window_stream,
)
from .plan import plan_figure, plan_slider, plan_versus_uniform, sensitivity_figure
from .published import (
    GMLX_KL_TABLE,
    LLAMA_CPP_ROTATION_PPL,
    REAL_DENSE_CONFIGS,
    benchmark_results,
    dense_bytes_per_token,
    family_curves,
)
from .quant import (
    AffineRow,
    affine_row,
    butterfly_stages,
    even_share,
    hadamard,
    normalize_history,
    normalize_rounds,
    outlier_ratio,
    outlier_row,
    quant_error,
    record_of,
    scale_spans,
)
from .say import Say, answer, assembled_lists, say
from .style import context_ticks, figure_problems, log_ticks, num, scheme_color, scheme_colors, trace_styles
from .tradeoff_figures import KL_SCALE, kl_color, kl_legend_html, published_vs_ours_figure, size_figure, tradeoff_figure
from .verdict_figures import floor_figure, verdict_figure

__all__ = [
    "AffineRow", "GMLX_KL_TABLE", "LLAMA_CPP_ROTATION_PPL", "LayerShape", "REAL_DENSE_CONFIGS", "REGION_COLORS",
    "Source", "Table", "affine_row", "affine_row_figure", "bars_figure", "benchmark_results", "butterfly_figure",
    "butterfly_stages", "bytes_label", "channel_figure", "code_histogram", "dense_bytes_per_token", "draft_figure",
    "error_figure", "even_share", "experiment_data", "family_curves", "figure_problems", "group_error_figure",
    "growth_figure", "hadamard", "imbalance_figure", "kernel_times_figure", "kl_strip", "layer_bytes",
    "layer_kind_figure", "layer_shapes", "normalize_history", "normalize_rounds", "normalize_toy_figure", "num",
    "outlier_ratio", "outlier_row", "passkey_heatmaps", "policy_bytes", "policy_strip", "position_kl_figure",
    "quant_error", "record_bytes", "record_figure", "record_of", "regions_bar", "regions_stream", "scheme_color",
    "scheme_colors", "sink_layers_figure", "sink_mass_figure", "source", "stall_figure", "stall_shares",
    "table_html", "trace_styles",
    "weights_kv_figure", "weights_kv_positions", "window_stream",
]
__all__ += ["Say", "answer", "assembled_lists", "say"]
__all__ += ["SchemeIdea", "field_kl_figure", "field_passkey_figure", "idea_figure", "scheme_idea"]
__all__ += ["context_ticks", "log_ticks"]
__all__ += ["butterfly_slider", "capacity_figure", "normalize_slider", "regions_slider", "scale_spans",
            "slider_figure", "verdict_figure", "floor_figure"]
__all__ += ["plan_figure", "plan_slider", "plan_versus_uniform", "sensitivity_figure"]
__all__ += ["EXAMPLE_MODEL", "EXAMPLE_TOKENS", "RunningExample", "example_model", "running_example"]
__all__ += ["KL_SCALE", "kl_color", "kl_legend_html", "published_vs_ours_figure", "size_figure", "tradeoff_figure"]


def _install_plotlyjs() -> None:
    if os.environ.get("PLOTLY_RENDERER"):
        return
    try:
        from IPython import get_ipython
    except ImportError:
        return
    plotlyjs.install(get_ipython())


_install_plotlyjs()
__all__ += ["DRAWN_IDEAS", "NO_DIAGRAM", "fused_step_figure", "kv_growth_figure", "record_layout_figure",
            "storage_figure"]
