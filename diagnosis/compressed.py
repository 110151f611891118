"""What log compression produces: kept entries (first text, counts, ranks, hosts) and stats.

Its own module so that the rule library (diagnosis.rules) can read a compressed log
without importing the compressor (diagnosis.filters), which itself loads the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diagnosis.signals import format_ranks


@dataclass(frozen=True)
class LogOrigin:
    """Whose console a log file holds: the node's name as the launcher gave it (the cluster
    inventory's, not a hostname the log prints), and the global rank of its local rank 0
    when known (torchrun's "[defaultN]:" prefix is the local rank N)."""

    node: str
    first_global_rank: int | None = None


@dataclass
class LogEntry:
    """One kept message: the first occurrence's text and where else it appeared."""

    text: str
    template: str
    count: int = 1
    # global ranks the lines name; an uncovered entry also counts a launcher prefix's rank,
    # torchrun's local "[defaultN]" included (signal entries keep those in `origins`)
    ranks: set[int] = field(default_factory=set)
    hosts: set[str] = field(default_factory=set)
    gpus: set[str] = field(default_factory=set)
    first_line: int = 0  # 1-based line numbers in the original log
    last_line: int = 0
    earliest_ts: float | None = None
    latest_ts: float | None = None  # of the latest-stamped occurrence (signal entries)
    signal: bool = False  # carries an error signal
    covered: bool = False  # a filter rule covers it (kept only for its signal)
    truncated: bool = False
    # Of each occurrence kept one by one (error-signal lines): the file's origin (None: the
    # file came without one) and torchrun's local rank where the line names no global rank.
    origins: set[tuple[LogOrigin | None, int | None]] = field(default_factory=set)

    def render(self) -> str:
        if self.count == 1:
            return self.text
        where = f" ranks {format_ranks(self.ranks)}" if self.ranks else ""
        return f"[x{self.count}{where}] {self.text}"


@dataclass
class CompressionStats:
    bytes_in: int = 0
    lines_in: int = 0
    lines_kept: int = 0  # before collapsing
    bytes_kept: int = 0  # text of the kept lines, before collapsing
    lines_signal: int = 0
    lines_uncovered: int = 0
    lines_truncated: int = 0
    # distinct messages beyond the entry budgets: counted, not kept
    uncovered_overflow: int = 0
    signal_overflow: int = 0
    seconds: float = 0.0


@dataclass
class CompressedLog:
    entries: list[LogEntry]
    stats: CompressionStats
    source: str = ""
    # global rank -> host, learned from NCCL init lines and torchrun failure summaries
    rank_hosts: dict[int, str] = field(default_factory=dict)
    # Training progress (signals.PROGRESS_PATTERN): (line number, timestamp or None) of
    # the last progress line of each error-free stretch (the lines between two
    # error-signal lines) of more than signals.PROGRESS_STRETCH_LINES lines that holds
    # one, in line order: stretches where training ran on without failing. A job's
    # final failure (signal lines close together, whatever is printed between them)
    # holds none.
    progress: list[tuple[int, float | None]] = field(default_factory=list)
    # the last line number of each file fed (several files of one job); empty: one stream
    file_ends: list[int] = field(default_factory=list)
    # (last line number, origin) of each file fed, in order (the origin None: a file given
    # without one); empty: no file was given an origin
    origin_ends: list[tuple[int, LogOrigin | None]] = field(default_factory=list)

    def origin_of_line(self, line: int) -> LogOrigin | None:
        """The origin of the file holding line number ``line`` (None: it came without one)."""
        start = 0
        for end, origin in self.origin_ends:
            if start < line <= end:
                return origin
            start = end
        return None

    def render(self) -> str:
        lines = [e.render() for e in self.entries]
        if self.stats.signal_overflow or self.stats.uncovered_overflow:
            lines.append(f"[compression budget exceeded: {self.stats.signal_overflow} error-signal and "
                         f"{self.stats.uncovered_overflow} uncovered lines of new kinds not kept]")
        return "\n".join(lines) + ("\n" if lines else "")

    @property
    def compressed_bytes(self) -> int:
        return len(self.render().encode("utf-8", "replace"))

    @property
    def ratio(self) -> float:
        return self.stats.bytes_in / max(self.compressed_bytes, 1)

    def progress_after(self, entry: LogEntry, until: int, min_seconds: float) -> bool:
        """True when training went on past every occurrence of ``entry`` before
        signal line ``until`` (where the job's final failure ends): an error-free
        stretch with progress (``progress``) after its last occurrence and before
        ``until``, in the same file, whose progress line, when both carry a timestamp,
        is at least ``min_seconds`` later than its latest one (files or nodes pasted one
        after the other are not progress after each other)."""
        last = entry.last_line
        file_end = next((end for end in self.file_ends if end >= last), None)
        entry_ts = entry.latest_ts if entry.latest_ts is not None else entry.earliest_ts
        for line, ts in reversed(self.progress):
            if line <= last:
                return False
            if line >= until or (file_end is not None and line > file_end):
                continue
            if ts is None or entry_ts is None or ts >= entry_ts + min_seconds:
                return True
        return False

    def signal_entries(self) -> list[LogEntry]:
        return [e for e in self.entries if e.signal]

    def uncovered_entries(self) -> list[LogEntry]:
        """Entries neither a filter rule nor the error-signal list covers."""
        return [e for e in self.entries if not e.signal and not e.covered]

    def uncovered_segments(self, max_lines: int = 200, gap: int = 50) -> list[list[str]]:
        """Uncovered lines grouped into segments for the log agent.

        Lines closer than ``gap`` original lines apart share a segment; segments are cut
        at ``max_lines`` lines. Each line appears once (collapsed repeats included).
        """
        segments: list[list[str]] = []
        current: list[str] = []
        last_line = None
        for entry in sorted(self.uncovered_entries(), key=lambda e: e.first_line):
            far = last_line is not None and entry.first_line - last_line > gap
            if current and (far or len(current) >= max_lines):
                segments.append(current)
                current = []
            current.append(entry.text)
            last_line = entry.last_line
        if current:
            segments.append(current)
        return segments
