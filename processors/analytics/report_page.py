"""The capacity report's page: one Jinja2 template, autoescaped, filled by `report.build_report`.

Every value is escaped by the engine; only the plots' SVG (matplotlib's own output, no input text
in it but labels it escapes itself) is passed through as markup. The page is self-contained: styles
inline, plots inline, no script, nothing fetched.
"""
from __future__ import annotations

from typing import Any

from jinja2 import Environment, StrictUndefined
from markupsafe import Markup

STYLE = """body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}
table{border-collapse:collapse;font-size:12px;margin:.5em 0 2em}td,th{border:1px solid #ccc;padding:2px 6px}
th{background:#f3f3f3}figure{margin:0}svg{max-width:100%;height:auto}.means{color:#444}.method{font-size:13px}"""

# Whitespace control keeps the markup compact (a table row is one line of cells).
TEMPLATE = """\
{%- macro table(t) -%}
{%- if not t.rows -%}<p><em>no rows</em></p>
{%- else -%}
<table><thead><tr>{% for c in t.columns %}<th>{{ c }}</th>{% endfor %}</tr></thead><tbody>
{%- for row in t.rows -%}<tr>{% for v in row %}<td>{{ v }}</td>{% endfor %}</tr>{%- endfor -%}
</tbody></table>
{%- if t.more > 0 %}<p><em>{{ t.more }} more rows: run the saved query for all</em></p>{% endif -%}
{%- endif -%}
{%- endmacro -%}
<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>kvpipe capacity report</title>\
<style>{{ style }}</style></head><body>\
<h1>kvpipe KV-cache capacity report</h1><p>Generated {{ generated }} from the saved queries \
(<code>kvpipe sql --saved NAME</code>; counts are exactly-once, read through the FINAL views).</p>\
<section id='store'><h2>What the store holds</h2>{{ table(store) }}</section>
{%- for s in sections -%}
<section id='{{ s.name }}'><h2>{{ s.title }}</h2>
{%- if s.plot is not none -%}
<p class='means'>{{ s.means }}</p><figure class='plot' data-query='{{ s.name }}'
{%- if s.bucket_s is not none %} data-bucket-s='{{ s.bucket_s }}' data-span='{{ s.span }}'{% endif %}>\
{{ s.plot }}</figure>
{%- endif -%}
{%- if s.method %}<p class='method'>{{ s.method }}</p>{% endif -%}
<p>Saved query <code>{{ s.name }}</code>.</p>{{ table(s.table) }}</section>
{%- endfor -%}
</body></html>"""

_PAGE = Environment(autoescape=True, undefined=StrictUndefined, keep_trailing_newline=False).from_string(TEMPLATE)


def render_page(generated: str, store: dict[str, Any], sections: list[dict[str, Any]]) -> str:
    """The page. `store` and each section's `table`: {columns, rows (cells as text), more}; a section's
    `plot` is SVG text (trusted, matplotlib's) or None."""
    for s in sections:
        if s.get("plot") is not None:
            s["plot"] = Markup(s["plot"])
    return _PAGE.render(style=Markup(STYLE), generated=generated, store=store, sections=sections)
