"""The bench's interleaving and its paired ratio: the order alternates every round, and a
ratio pairs runs of the same round, so drift between rounds cancels."""

from __future__ import annotations

from bench.measure import Row, interleaved_runs, paired_ratio


def test_interleaved_runs_reverse_the_order_every_other_round():
    order: list[str] = []

    def measure(name: str):
        def run() -> Row:
            order.append(name)
            return Row(name, float(len(order)))
        return run

    runs = interleaved_runs(3, {"a": measure("a"), "b": measure("b"), "c": measure("c")})
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert [r.tok_s for r in runs["a"]] == [1.0, 6.0, 7.0]  # every run kept, round order


def test_paired_ratio_is_the_median_of_same_round_ratios():
    # the machine halves its speed between rounds; within each round A is 0.9x the baseline
    assert paired_ratio([Row("a", 90.0), Row("a", 45.0), Row("a", 90.0)],
                        [Row("b", 100.0), Row("b", 50.0), Row("b", 100.0)]) == 0.9
    # per-round ratios 0.9, 1.2, 0.75 -> 0.9 (the ratio of the two medians would be 0.75)
    assert paired_ratio([Row("a", 90.0), Row("a", 60.0), Row("a", 60.0)],
                        [Row("b", 100.0), Row("b", 50.0), Row("b", 80.0)]) == 0.9


def test_prefix_bench_rounds_rotate_over_three_servers_and_report_the_a_a_control():
    from bench.prefix import paired

    class Sessions:
        n = 0

        def session(self) -> int:
            self.n += 1
            return self.n

    order: list[tuple[str, int]] = []
    speed = {"on": 95.0, "off": 100.0, "off2": 104.0}

    def measure(address: str, session: int) -> float:
        order.append((address, session))
        return speed[address] / (1 + (len(order) - 1) // 3)  # the machine slows each round

    got = paired(3, measure, {"on": "on", "off": "off", "off2": "off2"}, Sessions())
    assert [a for a, _ in order] == ["on", "off", "off2", "off", "off2", "on",
                                     "off2", "on", "off"]
    assert [s for _, s in order] == list(range(1, 10))  # a fresh session every run
    assert abs(got["ratio"] - 0.95) < 1e-9 and abs(got["aa_ratio"] - 1.04) < 1e-9
    two = paired(2, measure, {"on": "on", "off": "off"}, Sessions())
    assert "aa_ratio" not in two and len(two["on"]) == len(two["off"]) == 2
