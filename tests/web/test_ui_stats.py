"""The Stats page (/stats) over builds submitted through the API and finished as a worker finishes them: the
numbers in its tables, its SVG charts, the window in the URL, a bad window and who may see it."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest

from tests.fixtures.tokens import bearer, make_token
from tests.web.support import Env, complete_build, fail_build, spec_for
from web.ui.stats import Series, axis_seconds, column_chart, nice_ceiling


class Tables(HTMLParser):
    """Every <table>'s body rows, as the text of their cells."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self._cell: list[str] | None = None
        self._in_body = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self.tables[-1].append([])
        elif tag == "td" and self._in_body:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody":
            self._in_body = False
        elif tag == "td" and self._cell is not None:
            self.tables[-1][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def tables(html: str) -> list[list[list[str]]]:
    parser = Tables()
    parser.feed(html)
    return parser.tables


def column_sums(rows: list[list[str]], first: int, last: int) -> list[int]:
    return [sum(int(row[i]) for row in rows) for i in range(first, last + 1)]


def populate(env: Env) -> None:
    """One of each outcome: built (two buckets, 12.5 s each), joined, hit, and partly reused (a third bucket,
    40 s); and a trn1 build whose compile fails."""
    uri = env.upload()
    spec = spec_for(uri)
    first = env.submit(spec)
    assert first.json["outcome"] == "new"
    assert env.submit(spec).json["outcome"] == "join"
    complete_build(env.services, first.json["build_id"], compile_seconds=12.5)
    assert env.submit(spec).json["outcome"] == "hit"
    bigger = env.submit(spec_for(uri, buckets=((1, 8), (2, 8), (3, 8))))
    assert bigger.json["outcome"] == "new"
    complete_build(env.services, bigger.json["build_id"], compile_seconds=40.0)
    failing = env.submit(spec_for(uri, target="trn1", sdk="2.21.0", name="other", buckets=((4, 4),)))
    fail_build(env.services, failing.json["build_id"])


@pytest.mark.parametrize("window", ["day", "week"])
def test_stats_page_shows_the_windows_numbers(env: Env, window: str) -> None:
    populate(env)
    response = env.client.get(f"/stats?window={window}")
    assert response.status_code == 200
    html = response.get_data(as_text=True)
    outcomes, compile_times, failures, waits = tables(html)
    assert len(outcomes) == (24 if window == "day" else 7)
    # hit, joined, partly reused, built, total (the failing trn1 build is built too).
    assert column_sums(outcomes, 1, 5) == [1, 1, 1, 2, 5]
    assert "5 submits in this window: 1 answered from the cache (20%), 1 joined a build in flight, 1 reused" \
        in " ".join(html.split())
    # tiny-bert on cpu compiled three buckets: 12.5, 12.5, 40 s; p50 is rank 2, p95 rank 3.
    assert compile_times == [["tiny-bert", "cpu", "3", "12 s", "40 s"]]
    assert 'title="12.5 s"' in html and 'title="40.0 s"' in html
    assert failures == [["compile", "0", "1", "1"]]
    assert sum(int(row[1]) for row in waits) == 4  # four compiles started (three succeeded, one failed)
    assert "Compiles started in this window: 4;" in html
    # Each chart is an SVG with a title, and its bars carry their values.
    for chart in ("outcomes", "compile", "failures", "wait"):
        assert f'<title id="{chart}-title">' in html
    assert "tiny-bert · cpu: p95 40 s</title>" in html
    assert "compile: final 1</title>" in html
    assert f'<strong aria-current="page">{window}</strong>' in html


def test_default_window_is_the_day_and_the_nav_links_it(env: Env) -> None:
    response = env.client.get("/stats")
    assert response.status_code == 200
    html = response.get_data(as_text=True)
    assert '<strong aria-current="page">day</strong>' in html
    assert '<a href="/stats">Stats</a>' in html
    assert len(tables(html)[0]) == 24
    assert "No compile finished in this window." in html and "No failures in this window." in html


def test_bad_window_is_a_400_page(env: Env) -> None:
    response = env.client.get("/stats?window=month")
    assert response.status_code == 400
    html = response.get_data(as_text=True)
    assert "window must be one of day, week, not &#39;month&#39;" in html
    assert '<a href="/stats?window=week">week</a>' in html
    assert "<svg" not in html


def test_a_read_token_sees_the_page_a_fleet_token_does_not(env: Env) -> None:
    reader = make_token(env.services.sessions, "read")
    assert env.client.get("/stats", headers=bearer(reader)).status_code == 200
    fleet = make_token(env.services.sessions, "fleet")
    assert env.client.get("/stats", headers=bearer(fleet)).status_code == 403


def test_axes_end_on_round_values_with_round_halves() -> None:
    assert [nice_ceiling(v) for v in (0, 1, 3, 5, 11, 56, 450)] == [2, 2, 4, 6, 20, 60, 600]
    tops = [nice_ceiling(v, durations=True) for v in (0.7, 45, 150, 10740, 90000)]
    assert tops == [1, 60, 300, 14400, 172800]
    assert [axis_seconds(t / 2) for t in tops] == ["0.5 s", "30 s", "2 min 30 s", "2 h", "1 d"]
    assert axis_seconds(0) == "0"


def test_stacked_columns_scale_to_the_axis() -> None:
    chart = column_chart(["a", "b"], [Series("hit", "series-hit", [3, 0]), Series("built", "series-built", [1, 2])],
                         stacked=True)
    _, top, _, height = chart.plot
    assert [t.text for t in chart.value_ticks] == ["0", "2", "4"]  # 3 + 1 = 4 at most
    hit, built_a, built_b = chart.bars
    assert (hit.height, built_a.height, built_b.height) == (round(height * 3 / 4, 1), round(height / 4, 1),
                                                            round(height / 2, 1))
    assert built_a.y + built_a.height == hit.y  # stacked on the hit bar, which stands on the axis
    assert round(hit.y + hit.height, 1) == top + height
    assert (hit.title, built_b.title) == ("a: hit 3", "b: built 2")  # no bar for a zero
