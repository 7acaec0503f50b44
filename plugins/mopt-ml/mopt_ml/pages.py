"""HTML pages (bench's report.html, select's selection.html) from the jinja2 templates shipped
in `mopt_ml/templates/`, autoescaped: a label or a reason cannot break the page. jinja2 is
imported on first use."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def _environment() -> Any:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("mopt_ml"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render(template: str, **values: Any) -> str:
    """`templates/<template>` filled with `values`."""
    return str(_environment().get_template(template).render(**values))


def markup(text: str) -> Any:
    """`text` marked safe to insert as it is (our own SVG figures)."""
    import markupsafe

    return markupsafe.Markup(text)
