"""The doctor's diagnosis as text (``ampviz doctor``, wrapped to the terminal's width, or to a given width, at
word boundaries) and as HTML (the report's Findings section; a notebook shows a diagnosis this way)."""

from __future__ import annotations

import html
import shutil
import sys
import textwrap

from .._text import printable
from ._blocks import LABELS
from ._facts import percent

_ORDER = {"error": 0, "warning": 1, "info": 2}
WIDTH = 88                  # the width of text where there is no terminal to measure (a pipe, a notebook)


def headline(diagnosis: dict) -> str:
    """``"clean: no findings"`` or ``"3 findings (1 error, 2 warnings)"``."""
    found = diagnosis["findings"]
    if not found:
        n = sum(e["skipped"] for e in diagnosis["nonfinite_steps"])
        return "clean: no findings" + ("" if not n else "; its 1 skipped step was an ordinary loss-scale overflow"
                                       if n == 1 else f"; its {n} skipped steps were ordinary loss-scale overflows")
    counts = {s: sum(f["severity"] == s for f in found) for s in _ORDER}
    parts = [f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n]
    return f"{len(found)} finding{'s' if len(found) != 1 else ''} ({', '.join(parts)})"


def checks_line(diagnosis: dict) -> list[str]:
    """"checked: ..." (with rows that never filled, where some did not) and "not checked: ... (why)"."""
    ran = [c["check"] + (f" ({c['why']})" if c["why"] else "") for c in diagnosis["checks"] if c["ran"]]
    skipped = [f"{c['check']} ({c['why']})" for c in diagnosis["checks"] if not c["ran"]]
    lines = [f"checked: {', '.join(ran)}"] if ran else []
    return lines + ([f"not checked: {'; '.join(skipped)}"] if skipped else [])


def as_text(diagnosis: dict, label: str = "run", width: int | None = None) -> str:
    """The diagnosis of one run as lines of text: one line per finding, its evidence indented below it.

    ``width``: wrap lines at word boundaries to this many characters, continuation lines indented (default: the
    terminal's width; ``WIDTH`` in a notebook, whose output area is not the terminal its kernel started in, and
    where there is no terminal, e.g. a pipe); 0 never wraps. Control and bidi characters (from tensor names, the
    label) are escaped: the text goes to terminals.
    """
    if width is None:
        width = WIDTH if "ipykernel" in sys.modules else shutil.get_terminal_size((WIDTH, 24)).columns
    # the headline is never wrapped: one line per run, for scripts
    lines: list[tuple[str, str | None]] = [(f"{label}: {headline(diagnosis)}", None)]
    for f in diagnosis["findings"]:
        lines.append((f"  [{f['severity']}] {f['check']}: {f['summary']}", "      "))
        lines += [(f"      {d}", "        ") for d in f["details"]]
        lines.append((f"      what to do: {f['recommendation']}", "        "))
    lines += [(f"  {line}", "    ") for line in checks_line(diagnosis)]
    verdict = (diagnosis.get("updates") or {}).get("master_weights")
    if verdict:                                      # an fp32-weight run with updates= recorded
        lines.append((f"  {verdict}", "    "))
    if diagnosis.get("switch"):
        lines += [(line, "      ") for line in switch_text(diagnosis["switch"])]
    if diagnosis.get("blocks"):
        lines += [(line, "      ") for line in blocks_text(diagnosis["blocks"])]
    return "\n".join(_wrap(printable(text), indent, width) for text, indent in lines)


def _wrap(text: str, indent: str | None, width: int) -> str:
    if indent is None or width <= 0 or len(text) <= width:
        return text
    first = text[:len(text) - len(text.lstrip())]
    return textwrap.fill(text.strip(), width, initial_indent=first, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)


def _table(sw: dict) -> tuple[list[str], list[list[str]]]:
    head = ["tensor", "kind"] + [t["short"] for t in sw["targets"]] + ["verdict"]
    body = []
    for t in sw["tensors"]:
        cells = [_cell(t["shares"][tg["target"]]) for tg in sw["targets"]]
        body.append([printable(t["tensor"]), t["kind"]] + cells + [t["verdict"]])
    return head, body


def _cell(share: dict) -> str:
    return f"{percent(share['flushed'])} / {percent(share['overflow'])}"


def _aligned(head: list[str], body: list[list[str]]) -> list[str]:
    """A text table: every column but the last (a verdict, left ragged) padded to its widest cell."""
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head) - 1)]
    return ["    " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in [head] + body]


def switch_text(sw: dict) -> list[str]:
    """The "can I switch precision?" table as text lines."""
    lines = [f"  can I switch precision? (from {sw['from']}; cells: flushed / overflowed share of the non-zero "
             f"values; ok below {percent(sw['ok_share'])} flushed and nothing overflowed)"]
    lines += _aligned(*_table(sw))
    lines += [f"    {t['target']}: {t['verdict']}" for t in sw["targets"]]
    lines.append(f"    caveat: {sw['caveat']}")
    return lines




def _blocks_table(bt: dict) -> tuple[list[str], list[list[str]]]:
    names = [r["recipe"] for r in bt["recipes"]]
    head = ["tensor", "kind"] + [LABELS.get(n, n) for n in names] + ["verdict"]
    body = []
    for t in bt["tensors"]:
        cells = [_block_cell(t["cells"].get(n)) for n in names]
        body.append([printable(t["tensor"]), t["kind"]] + cells + [t["verdict"]])
    return head, body


def _block_cell(c: dict | None) -> str:
    if c is None:
        return "-"
    if c["ok"] is None and not c["status"].startswith("unsure"):
        return "poisoned" if c["poisoned"] else "-"
    return f"{percent(c['norm_lost'])} / {percent(c['rms_error'])}" + {True: "", False: " !", None: " ?"}[c["ok"]]


def blocks_text(bt: dict) -> list[str]:
    """The block-scaled what-if table as text lines."""
    steps = bt["steps"]
    lines = [f"  can I switch to block-scaled formats? (block statistics of {len(steps)} recorded step"
             f"{'s' if len(steps) != 1 else ''}; cells: share of the squared norm flushed / relative RMS error of "
             f"the cast, upper bounds; '!' marks a loss beyond the format's own rounding, '?' bounds that cannot "
             f"settle it)"]
    lines += _aligned(*_blocks_table(bt))
    lines += [f"    {LABELS.get(r['recipe'], r['recipe'])}: {r['verdict']}" for r in bt["recipes"]]
    lines.append(f"    caveat: {bt['caveat']}")
    return lines


def as_html(diagnosis: dict) -> str:
    """The report's Findings section: headline, one item per finding with its evidence and what to do."""
    e = html.escape
    parts = [f'<h3>Findings</h3><p class="note">{e(headline(diagnosis))}. '
             + " ".join(e(line) + "." for line in checks_line(diagnosis)) + "</p>"]
    if diagnosis["findings"]:
        items = []
        for f in diagnosis["findings"]:
            details = "".join(f"<li>{e(d)}</li>" for d in f["details"])
            what = f'<li><i>What to do:</i> {e(f["recommendation"])}</li>'
            items.append(f'<li class="finding {e(f["severity"])}"><b>[{e(f["severity"])}] {e(f["check"])}</b>: '
                         f'{e(f["summary"])}<ul>{details}{what}</ul></li>')
        parts.append(f'<ul class="findings">{"".join(items)}</ul>')
    sw = diagnosis.get("switch")
    if sw:
        head, body = _table(sw)
        rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in body)
        parts.append(f"<h4>Can I switch precision? (from {e(sw['from'])})</h4>"
                     f'<table class="summary"><tr>{"".join(f"<th>{e(h)}</th>" for h in head)}</tr>{rows}</table>'
                     + "".join(f'<p class="note">{e(t["target"])}: {e(t["verdict"])}</p>' for t in sw["targets"])
                     + f'<p class="note">{e(sw["caveat"])}</p>')
    bt = diagnosis.get("blocks")
    if bt:
        head, body = _blocks_table(bt)
        rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in body)
        parts.append("<h4>Can I switch to block-scaled formats?</h4>"
                     '<p class="note">Cells: share of the squared norm flushed / relative RMS error of the cast '
                     "(upper bounds); ! marks a loss beyond the format's own rounding, ? bounds that cannot settle "
                     "it.</p>"
                     f'<table class="summary"><tr>{"".join(f"<th>{e(h)}</th>" for h in head)}</tr>{rows}</table>'
                     + "".join(f'<p class="note">{e(LABELS.get(r["recipe"], r["recipe"]))}: {e(r["verdict"])}</p>'
                             for r in bt["recipes"])
                     + f'<p class="note">{e(bt["caveat"])}</p>')
    return "".join(parts)
