"""Mesh construction and logical-axis rules on 8 forced CPU devices."""

from __future__ import annotations

import re

import jax
import pytest
from jax.sharding import PartitionSpec as P

from strop.backends.jax.sharding import batch_sharding, logical_to_partition_spec, make_mesh
from strop.errors import ConfigError


def test_default_mesh_is_fsdp_over_all_devices():
    mesh = make_mesh()
    assert dict(mesh.shape) == {"data": 1, "fsdp": jax.device_count(), "tensor": 1}


@pytest.mark.parametrize(
    ("sizes", "shape"),
    [
        ({"fsdp": 4, "tensor": 2}, (1, 4, 2)),
        ({"data": 2, "fsdp": -1, "tensor": 2}, (2, 2, 2)),
        ({"data": -1, "fsdp": 1}, (8, 1, 1)),
    ],
)
def test_mesh_sizes(sizes, shape):
    assert tuple(make_mesh(sizes).shape.values()) == shape


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"fsdp": 3}, "do not fit 8 device"),
        ({"fsdp": -1, "tensor": -1}, "at most one mesh axis may be -1"),
        ({"pipeline": 2}, "mesh"),
        ({"tensor": 0}, "must be >= 1"),
    ],
)
def test_bad_mesh_sizes(sizes, message):
    with pytest.raises(ConfigError, match=message):
        make_mesh(sizes)


def test_rules_split_only_dimensions_they_divide():
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    assert logical_to_partition_spec(("embed", "heads", "head_dim"), (64, 8, 16), mesh) == P(
        "fsdp", "tensor", None
    )
    # 2 KV heads cannot be split 4 ways: that dimension stays replicated.
    assert logical_to_partition_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh) == P(
        "fsdp", None, None
    )
    assert logical_to_partition_spec(("norm",), (64,), mesh) == P(None)
    with pytest.raises(ValueError, match="no sharding rule"):
        logical_to_partition_spec(("nonsense",), (4,), mesh)


def test_a_flat_heads_dim_splits_only_into_whole_heads():
    """Flat projection kernels ``[embed, heads * head_dim]``: the divisibility test counts
    heads (blocks of head_dim), not elements. 2 KV heads x 16 = 32 elements would divide
    by 4, but splitting them 4 ways would cut each head in half: replicated instead."""
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    q = logical_to_partition_spec(("embed", "heads"), (64, 8 * 16), mesh, blocks=(1, 16))
    assert q == P("fsdp", "tensor")
    k = logical_to_partition_spec(("embed", "kv_heads"), (64, 2 * 16), mesh, blocks=(1, 16))
    assert k == P("fsdp", None)
    o = logical_to_partition_spec(("heads", "embed"), (8 * 16, 64), mesh, blocks=(16, 1))
    assert o == P("tensor", "fsdp")
    with pytest.raises(ValueError, match="do not tile"):
        logical_to_partition_spec(("embed", "heads"), (64, 100), mesh, blocks=(1, 16))


def test_flat_kv_kernels_of_a_loaded_model_keep_whole_heads(tiny_model_dir):
    """Through the loader: a model whose 2 KV heads do not divide ``tensor=4`` keeps k/v
    replicated over tensor, while q (4 heads) is split by whole heads."""
    from strop.backends.jax.weights import load_hf_model

    model = load_hf_model(tiny_model_dir("qwen2"), make_mesh({"fsdp": 2, "tensor": 4}))
    attn = model.model.layers[0].self_attn
    spec = model.spec
    assert (spec.num_heads, spec.num_kv_heads) == (4, 2)
    k = attn.k_proj.kernel.get_value()
    assert k.shape == (spec.hidden_size, spec.num_kv_heads * spec.head_dim)
    assert k.sharding.spec == P("fsdp", None)
    assert attn.k_proj.bias.get_value().sharding.spec == P(None)
    q = attn.q_proj.kernel.get_value()
    assert q.sharding.spec == P("fsdp", "tensor")
    assert q.addressable_shards[0].data.shape[1] == spec.head_dim  # one whole head each


def test_batch_shards_over_data_and_fsdp():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert batch_sharding((8, 16), mesh).spec == P(("data", "fsdp"), None)
    assert batch_sharding((2, 16), mesh).spec == P("data", None)


@pytest.mark.parametrize(
    ("env", "message"),
    [({"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' must be an integer of at least 1"),
     ({"JAX_NUM_PROCESSES": "0"}, "JAX_NUM_PROCESSES='0' must be an integer of at least 1"),
     ({"JAX_PROCESS_ID": "-1"}, "JAX_PROCESS_ID='-1' must be an integer of at least 0"),
     ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
      "JAX_PROCESS_ID=2 is not below JAX_NUM_PROCESSES=2")],
)  # fmt: skip
def test_a_bad_multi_process_launch_is_a_config_error(monkeypatch, env, message):
    """Checked before JAX is asked to join anything (which would wait for peers)."""
    from strop.backends.jax.sharding import join_processes

    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        join_processes()


def test_without_a_coordinator_address_there_is_one_process(monkeypatch):
    from strop.backends.jax.sharding import join_processes

    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "not read")
    join_processes()
    assert jax.process_count() == 1
