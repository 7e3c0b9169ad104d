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
