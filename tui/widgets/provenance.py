"""Markdown that tints each character by the provenance of the token it came from.

Textual's Markdown renders blocks from markdown-it tokens and re-renders only the last block
on `append`. The tint is applied where a block's inline Content is built: its rendered text is
aligned (greedy, in order) with the source lines the block covers, and runs of equal labels
become spans styled by component classes (``prov-d1`` … ``prov-d7``, ``prov-l``, ``prov-t``).
"""

from __future__ import annotations

from collections import deque

from markdown_it.token import Token
from textual.content import Content, Span
from textual.style import Style
from textual.widgets import Markdown, Static
from textual.widgets._markdown import MarkdownBlock, MarkdownFence

from ..turn import LOOKUP, TARGET

DRAFT_SHADES = 7
COMPONENTS = {f"prov-d{i}" for i in range(1, DRAFT_SHADES + 1)} | {"prov-l", "prov-t"}
_SEARCH_WINDOW = 64
LEGEND_WIDTH = 32  # the speculation panel's inner width


def label_class(label: int) -> str:
    """The component class of a provenance label ('' for none)."""
    if label == TARGET:
        return "prov-t"
    if label == LOOKUP:
        return "prov-l"
    if label > 0:
        return f"prov-d{min(label, DRAFT_SHADES)}"
    return ""


def align_spans(plain: str, source: str, labels, start: int, end: int) -> list[Span]:
    """Spans over `plain` (a block's rendered text) from the labels of source[start:end].

    Markdown removes syntax (`**`, backticks, list markers) and collapses whitespace, so the
    rendered text is nearly a subsequence of its source: match each character at the next
    equal source character within a short window; unmatched characters stay untinted.
    """
    spans: list[Span] = []
    end = min(end, len(source))
    n_labels = len(labels)
    j, run, run_start = start, 0, 0
    for i, ch in enumerate(plain):
        limit = min(end, j + _SEARCH_WINDOW)
        if ch.isspace():
            k = j
            while k < limit and not source[k].isspace():
                k += 1
        else:
            k = source.find(ch, j, limit)
            if k < 0:
                k = limit
        label = 0
        if k < limit:
            label = labels[k] if k < n_labels else 0
            j = k + 1
        if label != run:
            if run:
                spans.append(Span(run_start, i, "." + label_class(run)))
            run, run_start = label, i
    if run:
        spans.append(Span(run_start, len(plain), "." + label_class(run)))
    return spans


class _Tinted:
    """Mixin for paragraph-like blocks: tint the inline Content once it is built."""

    def _token_to_content(self, token: Token) -> Content:
        content = super()._token_to_content(token)  # type: ignore[misc]
        return self._markdown.tint(content, token)  # type: ignore[attr-defined]


class _TintedFence(MarkdownFence):
    """Code blocks: tint the highlighted code (re-done when the theme changes)."""

    def highlight(self, code: str, language: str, ansi: bool = False, dark: bool = False):
        content = MarkdownFence.highlight(code, language, ansi=ansi, dark=dark)
        return self._markdown.tint(content, self._token)


def _tinted_blocks() -> dict[str, type[MarkdownBlock]]:
    blocks: dict[str, type[MarkdownBlock]] = {}
    for name, cls in Markdown.BLOCKS.items():
        if issubclass(cls, MarkdownFence):
            blocks[name] = _TintedFence
        else:
            blocks[name] = type(cls.__name__, (_Tinted, cls), {})
    return blocks


class _TintStyles:
    """Resolve the tint component classes to their CSS background as is.

    Textual's partial component styles blend a background with itself (weakening it to a
    few percent); a tint must composite at the alpha the stylesheet gives.
    """

    def get_visual_style(self, *component_classes: str, partial: bool = False) -> Style:
        if len(component_classes) == 1 and component_classes[0] in COMPONENTS:
            cache = self.__dict__.setdefault("_tint_styles", {})
            name = component_classes[0]
            if name not in cache:
                styles = self.get_component_styles(name)  # type: ignore[attr-defined]
                cache[name] = Style(
                    background=styles.background if styles.has_rule("background") else None)
            return cache[name]
        return super().get_visual_style(*component_classes, partial=partial)  # type: ignore[misc]

    def notify_style_update(self) -> None:
        self.__dict__.pop("_tint_styles", None)
        super().notify_style_update()  # type: ignore[misc]


class ProvenanceMarkdown(_TintStyles, Markdown):
    """A Markdown document whose characters carry provenance labels.

    Feed it with `write(text, labels)` (one label per character; a `MarkdownStream` joins
    fragments when rendering falls behind), then `close_stream()`. The tint is hidden while
    the app has the ``-no-provenance`` class (call `restyle()` after changing it).
    """

    COMPONENT_CLASSES = COMPONENTS
    BLOCKS = _tinted_blocks()

    def __init__(self, markdown: str | None = None, labels=None, **kwargs):
        super().__init__(markdown, **kwargs)
        self.labels = bytearray(labels or b"")
        self._bases: deque[int] = deque()
        self._base = 0
        self._line_starts = [0]
        self._scanned = 0
        self._stream = None

    # -- streaming -----------------------------------------------------------------------
    async def write(self, text: str, labels: list[int]) -> None:
        """Append text with one provenance label per character."""
        if not text:
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self)
        self.labels.extend(labels)
        await self._stream.write(text)

    async def close_stream(self) -> None:
        """Wait until every written fragment is rendered."""
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.stop()

    # -- tinting hooks ---------------------------------------------------------------------
    def update(self, markdown: str):
        self._bases.append(0)
        self._line_starts, self._scanned = [0], 0
        return super().update(markdown)

    def append(self, markdown: str):
        # Textual parses from this line on; appends are serialised by the document lock.
        self._bases.append(self._last_parsed_line)
        return super().append(markdown)

    def _parse_markdown(self, tokens):
        self._base = self._bases.popleft() if self._bases else 0
        yield from super()._parse_markdown(tokens)

    def _line_start(self, line: int) -> int:
        source = self.source
        starts = self._line_starts
        while len(starts) <= line and self._scanned < len(source):
            i = source.find("\n", self._scanned)
            if i < 0:
                self._scanned = len(source)
                break
            starts.append(i + 1)
            self._scanned = i + 1
        return starts[line] if line < len(starts) else len(source)

    def restyle(self) -> None:
        """Re-render after the provenance toggle (component styles are cached per widget)."""
        for widget in (self, *self.query("*")):
            widget.notify_style_update()
            widget.refresh()

    def tint(self, content: Content, token: Token) -> Content:
        """Add provenance spans to a block's Content built from `token`."""
        if not self.labels or token.map is None or not content.plain:
            return content
        first, last = token.map
        if token.type == "fence":
            first += 1  # skip the ``` line
        start = self._line_start(self._base + first)
        end = self._line_start(self._base + last)
        return content.add_spans(align_spans(content.plain, self.source, self.labels, start, end))


class ProvenanceLegend(_TintStyles, Static):
    """Explains the tint colours."""

    COMPONENT_CLASSES = COMPONENTS

    def __init__(self, block_size: int = 5, **kwargs):
        super().__init__(**kwargs)
        self.block_size = block_size

    def on_mount(self) -> None:
        self.set_block_size(self.block_size)

    def set_block_size(self, block_size: int) -> None:
        self.block_size = block_size
        parts: list[Content] = [Content("draft ")]
        for pos in range(1, max(block_size, 2)):
            if pos > 1:
                parts.append(Content(" "))
            parts.append(Content(f"{pos}").stylize("." + label_class(pos)))
        head = Content("").join(parts)
        tail = Content("").join([Content("lookup").stylize(".prov-l"), Content(" "),
                                 Content("target").stylize(".prov-t")])
        # wide blocks put the rest on a second line rather than wrap inside a word
        width = self.content_size.width or LEGEND_WIDTH
        gap = "  " if head.cell_length + 2 + tail.cell_length <= width else "\n"
        self.update(Content("").join([head, Content(gap), tail]))
