"""``/api/history`` beyond the monitor's memory: the T4 files, joined and thinned.

A monitor's memory starts empty; what came before is read back from its T4
day files. These tests write T4 files with points from hours ago (or let one
monitor write them and start another), then ask ``/api/history``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import wait_for
from ringq.engine import connect
from ringq.engine import metrics as M
from ringq.monitor import KIND_KEYS, client_kinds, kind_rows, t4_queues, t4_rows
from ringq.monitor import _sample as S
from ringq.monitor._history import BUCKET, HistoryReader, downsample
from ringq.monitor._t4 import HEADER, KINDS, T4Reader, T4Writer, file_for
from ringq.rtv import _metrics as K

# The monitor test module's helpers (the monitor fixture is in conftest).
from test_monitor import get_json, http, produce, queue_doc

WIDTH = len(S.NUMERIC_KEYS)


def sample(name: str, t: float, **figures: float) -> dict[str, float | str]:
    s: dict[str, float | str] = {S.NAME: name, **{k: 1.0 for k in S.NUMERIC_KEYS}}
    s.update(figures)
    s[S.T] = round(t, 3)
    return s


def write_rows(data_dir: Path, name: str, times: list[float], **figures: float) -> None:
    """Rows of ``name`` at ``times`` appended to the day files, as the monitor writes them."""
    w = T4Writer(data_dir, keep_days=14)
    try:
        for t in times:
            w.write([sample(name, t, **figures)])
    finally:
        w.close()


def write_day_fast(path: Path, names: list[str], start: float, n: int) -> None:
    """``n`` rows per queue one second apart in T4 format, written at once (a full day in a
    second)."""
    rest = ",".join("7" for _ in S.NUMERIC_KEYS[1:])
    with open(path, "w", encoding="utf-8") as f:
        f.write(HEADER + "\n")
        for i in range(n):
            t = start + i
            stamp = datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")
            f.writelines(f"{stamp},{t:.3f},{name},{rest}\n" for name in names)


def fetch(url: str) -> Any:
    """GET JSON, allowing for a first parse of a day's file on a loaded machine."""
    with urllib.request.urlopen(url, timeout=120) as resp:
        return json.loads(resp.read())


# -- thinning -------------------------------------------------------------------------------


def test_history_bucket_rules_are_the_viewers() -> None:
    assert {k: v for k, v in BUCKET.items() if k != S.T} == K.BUCKET


@pytest.mark.parametrize("max_points", [2, 3, 10, 100, 1800, 5000])
def test_history_downsampling_never_exceeds_max_points(max_points: int) -> None:
    rng = np.random.default_rng(max_points)
    t = 1_900_000_000.0 + np.cumsum(rng.uniform(0.5, 1.5, 86_400))
    rows = np.ones((len(t), WIDTH))
    rows[:, 0] = t
    p99 = S.NUMERIC_KEYS.index(M.ENQ_P99)
    rate = S.NUMERIC_KEYS.index(M.ENQ_RATE)
    rows[40_000, p99] = 9_999.0
    rows[:, rate] = np.arange(len(t)) % 2 * 2.0  # alternating 0, 2: mean 1
    out, step = downsample(rows, max_points=max_points)
    assert 1 <= len(out) <= max_points and step > 0
    assert out[-1, 0] == t[-1]  # stamped with the bucket's last time: since=<it> continues
    assert np.all(np.diff(out[:, 0]) > 0)
    assert out[:, p99].max() == 9_999.0  # the spike survives
    if max_points >= 100:
        assert abs(out[1:-1, rate].mean() - 1.0) < 0.05
    same, used = downsample(rows[:10], max_points=10)
    assert used == 0.0 and np.array_equal(same, rows[:10])


def test_history_step_buckets_fall_on_round_times() -> None:
    rows = np.ones((600, WIDTH))
    rows[:, 0] = 1_900_000_007.0 + np.arange(600)
    out, step = downsample(rows, step=60.0)
    assert step == 60.0
    # buckets end at the last sample before each whole minute
    assert all((t + 1) % 60 == 0 for t in out[:-1, 0])
    assert len(out) == 11


# -- reading T4 files back --------------------------------------------------------------------


def test_history_t4_reader_reads_back_caches_and_reads_on(tmp_path: Path) -> None:
    midnight = datetime(2030, 5, 2, tzinfo=UTC).timestamp()
    times = [midnight - 5 + i for i in range(10)]  # 5 in yesterday's file, 5 in today's
    write_rows(tmp_path, "qa", times, depth=3)
    write_rows(tmp_path, "qb", times, depth=4)
    r = T4Reader(tmp_path)
    rows = r.read("qa", midnight - 100, midnight + 100)
    assert rows[:, 0].tolist() == times
    assert set(rows[:, S.NUMERIC_KEYS.index(M.DEPTH)]) == {3.0}
    assert r.read("qa", times[2], times[6])[:, 0].tolist() == times[3:7]  # since < t <= until
    parsed = r.parsed_rows
    assert r.read("qa", midnight - 100, midnight + 100).shape == (10, WIDTH)
    assert r.parsed_rows == parsed  # cached: nothing parsed again
    assert len(r.read("nope", 0, midnight + 100)) == 0

    # Today's file grows (a torn row first, as after a kill -9 mid-write): only the new
    # rows are parsed.
    today = file_for(tmp_path, datetime(2030, 5, 2, tzinfo=UTC).date())
    with open(today, "a") as f:
        f.write("2030-05-02T00:00:05.000+00:00,1903")  # no newline: torn
    write_rows(tmp_path, "qa", [midnight + 5, midnight + 6])
    got = r.read("qa", midnight - 100, midnight + 100)
    assert got[:, 0].tolist() == [*times, midnight + 5, midnight + 6]
    assert r.parsed_rows == parsed + 2
    # A request that needs nothing newer than what was read does not read on.
    write_rows(tmp_path, "qa", [midnight + 7])
    assert r.read("qa", midnight - 100, midnight + 1)[:, 0].tolist() == [
        t for t in times if t <= midnight + 1
    ]
    assert r.parsed_rows == parsed + 2


def test_history_memory_and_files_join_without_duplicates(tmp_path: Path) -> None:
    now = datetime(2030, 5, 2, 0, 30, tzinfo=UTC).timestamp()  # half an hour into the day
    before = [now - 3 * 3600 + i for i in range(0, 3 * 3600 - 600, 10)]  # crosses midnight
    write_rows(tmp_path, "q", before)
    mem = S.History(1000)
    live = [now - 600 + i for i in range(0, 600, 10)]
    for t in live:  # the running monitor writes both (memory and today's file)
        mem.add(sample("q", t))
    write_rows(tmp_path, "q", live)
    h = HistoryReader(mem, T4Reader(tmp_path))
    got = h.query("q", now - 4 * 3600, now=now)
    assert got is not None
    ts = [p[S.T] for p in got.points]
    assert ts == before + live and got.from_files == len(before) and got.step == 0.0
    # Within the memory only: the files are not read.
    inner = h.query("q", live[3], now=now)
    assert (
        inner is not None and [p[S.T] for p in inner.points] == live[4:] and inner.from_files == 0
    )
    # reach bounds how far back the files go, whatever since says
    far = HistoryReader(mem, T4Reader(tmp_path), reach=3600).query("q", 0, now=now)
    assert far is not None and far.points[0][S.T] > now - 3600
    thinned = h.query("q", now - 4 * 3600, max_points=50, now=now)
    assert thinned is not None and len(thinned.points) <= 50 and thinned.points[-1][S.T] == live[-1]
    assert h.query("other", 0, now=now) is None


# -- the client kinds' file ------------------------------------------------------------------


def kind_row(kind: str, t: float, **counts: float) -> dict[str, float | str]:
    row: dict[str, float | str] = {"role": kind, **{k: 0 for k in KIND_KEYS}}
    row.update(counts)
    row["t"] = round(t, 3)
    return row


def test_history_kinds_file_lives_beside_the_queues_and_reads_back_by_kind(
    tmp_path: Path,
) -> None:
    day = datetime(2030, 5, 1, 12, tzinfo=UTC).timestamp()
    old = datetime(2030, 4, 1, 12, tzinfo=UTC).timestamp()
    write_rows(tmp_path, "q", [day, day + 1])
    kinds = T4Writer(tmp_path, keep_days=3, fmt=KINDS)
    try:
        kinds.write([kind_row("client", old, enqueued=9)])  # a month old: pruned below
        kinds.write([kind_row("client", day, clients=2, interval_s=0.5, enqueued=7),
                     kind_row("worker", day, clients=1, interval_s=0.5, handled=3)])
        kinds.write([kind_row("client", day + 1, clients=1, interval_s=1, enqueued=1)])
        path = kinds.path
    finally:
        kinds.close()
    assert path == tmp_path / "t4-kinds-2030-05-01.csv"
    lines = path.read_text().splitlines()
    assert lines[0] == "time,t,role," + ",".join(KIND_KEYS[1:]) and len(lines) == 4
    # each format prunes its own files only: the queues' file of the day stays
    assert not (tmp_path / "t4-kinds-2030-04-01.csv").exists()
    assert file_for(tmp_path, datetime(2030, 5, 1).date()).is_file()
    t0, t1 = day - 3600, day + 3600
    assert client_kinds(tmp_path, t0, t1) == ["client", "worker"]
    assert t4_queues(tmp_path, t0, t1) == ["q"]  # the kinds are not queues
    assert list(t4_rows(tmp_path, t0, t1)) == ["q"]
    got = kind_rows(tmp_path, t0, t1)
    col = {k: i for i, k in enumerate(KIND_KEYS)}
    client, worker = got["client"], got["worker"]
    assert client.shape == (2, len(KIND_KEYS)) and worker.shape == (1, len(KIND_KEYS))
    assert list(client[:, col["t"]]) == [day, day + 1]
    assert list(client[:, col[M.ENQUEUED]]) == [7, 1] and list(client[:, col["clients"]]) == [2, 1]
    assert worker[0, col[M.HANDLED]] == 3 and worker[0, col["interval_s"]] == 0.5
    assert list(kind_rows(tmp_path, t0, t1, ["worker", "mover"])) == ["worker"]
    assert kind_rows(tmp_path, day + 1, t1) == {}


def test_history_kinds_counts_survive_clients_exiting(
    dsn: str, make_queue: Any, monitor: Any, tmp_path: Path
) -> None:
    """A monitor's kind rows count each client's calls once, exactly, though the
    clients exit: sums of per-client deltas, never a total that drops when one leaves."""
    q = make_queue()
    data_dir = tmp_path / "monitor"
    t0 = time.time()
    monitor(data_dir=data_dir)
    col = {k: i for i, k in enumerate(KIND_KEYS)}

    def clients() -> np.ndarray:
        return kind_rows(data_dir, t0, time.time() + 1).get("client", np.empty((0, len(col))))

    for n in (5, 3):  # two clients, one after the other, each closed once counted
        want = clients()[:, col[M.ENQUEUED]].sum() + n
        with connect(dsn) as s:
            for i in range(n):
                s.enqueue(q, b"k%d" % i)
                s.commit()
            wait_for(lambda: clients()[:, col[M.ENQUEUED]].sum() >= want,  # noqa: B023
                     what="the client's calls counted")
        wait_for(lambda: clients()[-1, col["clients"]] == 0, what="the client gone")
    n = len(clients())
    # a kind with no client left keeps a row of 0 per sample: no gap in its line
    wait_for(lambda: len(clients()) >= n + 2, what="two more samples")
    rows = kind_rows(data_dir, t0, time.time() + 1)["client"]
    assert (rows[n - 1:, col["clients"]] == 0).all() and (rows[n - 1:, 3:] == 0).all()
    assert rows[:, col[M.ENQUEUED]].sum() == 8 and rows[:, col[M.COMMITS]].sum() == 8
    assert (rows[:, 1:] >= 0).all()  # no count ran backwards when a client left
    assert set(rows[:, col["clients"]]) >= {0, 1}
    assert (rows[:, col["interval_s"]] > 0).all()


# -- through HTTP, with real monitors ------------------------------------------------------------


def test_history_after_a_restart_serves_the_t4_files(
    dsn: str, make_queue: Any, monitor: Any, tmp_path: Path
) -> None:
    q = make_queue()
    data_dir = tmp_path / "monitor"
    now = time.time()
    hours_ago = [round(now - 3 * 3600 + i * 5, 3) for i in range(720)]  # an hour of points, 3 h ago
    write_rows(data_dir, q, hours_ago, depth=42)

    first = monitor()
    produce(dsn, q, 3)
    base = first.url

    def sampled(n: int) -> Any:
        def cond() -> Any:
            # 404 until the monitor's first sample of the queue, when the rows
            # written above lie in yesterday's file (a run between 00:00 and
            # 03:00 UTC) and so are not read for a since of a minute ago.
            status, body, _ = http(base + f"/api/history?queue={q}&since={now - 60}")
            if status == 404:
                return None
            assert status == 200, (status, body)
            pts = json.loads(body)["points"]
            return pts if len(pts) >= n else None
        return cond

    ran = wait_for(sampled(5), what="the first monitor's samples")
    first.stop()

    second = monitor()
    base = second.url
    produce(dsn, q, 2)
    wait_for(sampled(len(ran) + 5), what="the second monitor's samples")
    doc = get_json(base + f"/api/history?queue={q}&since={now - 4 * 3600}")
    ts = [p["t"] for p in doc["points"]]
    assert ts == sorted(set(ts)), "ordered, no duplicates"
    assert ts[: len(hours_ago)] == hours_ago
    assert all(p["depth"] == 42 for p in doc["points"][: len(hours_ago)])
    assert {p["t"] for p in ran} <= set(ts)  # the first monitor's points, from today's file
    assert ts[-1] > ran[-1]["t"]  # and the second's, from memory
    assert doc["step"] == 0 and set(doc["points"][0]) == set(S.NUMERIC_KEYS)

    # since=<the last t> gives only newer points, as before
    newer = get_json(base + f"/api/history?queue={q}&since={ts[-2]}")["points"]
    assert newer[0]["t"] == ts[-1]

    thin = get_json(base + f"/api/history?queue={q}&since={now - 4 * 3600}&max_points=20")
    assert 2 <= len(thin["points"]) <= 20 and thin["step"] > 0
    assert max(p["depth"] for p in thin["points"]) == 42
    assert thin["points"][-1]["t"] >= ts[-1]
    stepped = get_json(base + f"/api/history?queue={q}&since={now - 4 * 3600}&step=600")
    assert stepped["step"] == 600 and len(stepped["points"]) <= 4 * 6 + 2
    for bad in ("max_points=1", "max_points=x", "step=-1", "step=1e9"):
        assert http(base + f"/api/history?queue={q}&{bad}")[0] == 400


def test_history_a_day_of_one_second_samples_is_served_thinned(
    dsn: str, make_queue: Any, monitor: Any, tmp_path: Path
) -> None:
    q = make_queue()
    data_dir = tmp_path / "monitor"
    data_dir.mkdir(parents=True)
    now = time.time()
    # A whole day of 1 s samples before the monitor starts, in yesterday's and today's files.
    start = now - 86_400 + 30
    midnight = datetime.fromtimestamp(now, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    cut = int(midnight.timestamp() - start)
    write_day_fast(
        file_for(data_dir, (midnight - timedelta(days=1)).date()), [q, "other_q"], start, cut
    )
    write_day_fast(
        file_for(data_dir, midnight.date()), [q, "other_q"], start + cut, 86_400 - 60 - cut
    )
    m = monitor()
    # (not /api/history: the files stay unread)
    wait_for(lambda: queue_doc(m.url, q), what="a sample")

    timings = []
    for _ in range(2):
        t0 = time.perf_counter()
        doc = fetch(m.url + f"/api/history?queue={q}&since={now - 86_400}&max_points=1800")
        timings.append(time.perf_counter() - t0)
        assert 1000 <= len(doc["points"]) <= 1800 and doc["step"] == 60
        ts = [p["t"] for p in doc["points"]]
        assert ts == sorted(set(ts))
    t0 = time.perf_counter()
    raw = fetch(m.url + f"/api/history?queue={q}&since={now - 86_400}")  # unthinned: tens of MB
    timings.append(time.perf_counter() - t0)
    assert len(raw["points"]) >= 86_000
    print(f"\n/api/history, a day of 1 s samples from T4: first {timings[0]:.2f} s, "
          f"cached {timings[1]:.3f} s (thinned to {len(doc['points'])}); raw {timings[2]:.2f} s")
    assert timings[1] < 2.0
