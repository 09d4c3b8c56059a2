"""KVOutputAggregator: the ranks' load reports under tensor parallelism."""

from __future__ import annotations

from vlite.kv_connector.base import KVConnectorOutput, KVOutputAggregator


def test_tensor_parallel_reports_merge_once_every_rank_answered():
    agg = KVOutputAggregator(2)
    assert agg.aggregate([None, None]) is None
    assert agg.aggregate([KVConnectorOutput({"a": 3, "b": 2}), None]).finished_recving == {}
    assert agg.aggregate([None, KVConnectorOutput({"a": 1})]).finished_recving == {"a": 1}  # the fewest loaded
    assert agg.aggregate([KVConnectorOutput(), KVConnectorOutput({"b": 2})]).finished_recving == {"b": 2}
