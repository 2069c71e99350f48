"""Live redeploy in process: requests in flight through a chain of role changes that covers
every kind of change keep transformers' greedy tokens, none is lost, nothing stays held."""

from __future__ import annotations

import pytest

from hydrad import LLM, SamplingParams
from hydrad.cluster.deploy import parse_deploy
from hydrad.cluster.redeploy import RoleChange, format_deploy, plan_redeploy
from test_llm_correctness import MAX_TOKENS, conversations, reference  # noqa: F401 (fixtures)


def test_plan_matches_instances_to_roles_to_move_the_fewest_stages():
    assert plan_redeploy(["EP", "D"], ["D", "EP"]) == []  # the same deployment, listed otherwise
    assert plan_redeploy(["EPD", "EPD"], ["E", "PD"]) == [RoleChange(0, "EPD", "E"), RoleChange(1, "EPD", "PD")]
    first, second = plan_redeploy(["E", "PD"], ["EP", "D"])
    assert (first.union, first.gains, first.loses) == ("EP", "P", "") and (second.gains, second.loses) == ("", "P")
    # EP+D -> ED+P: moving E (2 stages) beats swapping P and D (4 stages)
    changes = plan_redeploy(["EP", "D"], ["ED", "P"])
    assert [(c.old, c.new) for c in changes] == [("EP", "P"), ("D", "ED")]
    assert format_deploy(parse_deploy("2PD+1E")) == "1E+2PD"
    with pytest.raises(ValueError, match="keeps the devices"):
        plan_redeploy(["EPD"], ["E", "PD"])


def run_through_chain(llm: LLM, conversations, chain: list[str], every: int) -> dict[str, list[int]]:
    """Submit every conversation, step, and start the next redeploy of ``chain`` every
    ``every`` steps while requests are in flight; the tokens of each request."""
    cluster = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    tokens: dict[str, list[int]] = {}
    for i, conv in enumerate(conversations):
        request = llm.processor.make_engine_request(f"r{i}", llm.processor.process_chat(conv), params)
        cluster.add_request(request)
        tokens[request.req_id] = []
    unfinished, steps, pending = set(tokens), 0, list(chain)
    done_chain = []
    while unfinished or cluster.redeploying:
        output = cluster.step()
        for req_id, token in zip(output.req_ids, output.token_ids):
            tokens[req_id].append(token)
        unfinished -= {f.req_id for f in output.finished}
        steps += 1
        if pending and steps % every == 0 and not cluster.redeploying and unfinished:
            cluster.redeploy(parse_deploy(pending[0]))
            done_chain.append(pending.pop(0))
        assert steps < 20_000
    assert done_chain == chain, f"redeploys started: {done_chain}"
    return tokens


@pytest.mark.parametrize("start, devices, chain", [
    ("2EPD", "cpu:2", ["1E+1PD", "1EP+1D", "1ED+1P", "2EPD"]),
    ("3EPD", "cpu:3", ["1E+1P+1D", "1EP+1ED+1D", "3EPD"]),
])
def test_redeploy_chain_keeps_greedy_tokens_exact(tiny_llava_dir, conversations, reference, start, devices, chain):
    llm = LLM(str(tiny_llava_dir), deploy=start, devices=devices, worker_processes=False, token_budget=12,
              kv_block_size=4)
    convs = conversations * 2
    tokens = run_through_chain(llm, convs, chain, every=6)
    for i, conv in enumerate(convs):
        assert tokens[f"r{i}"] == reference[i % len(conversations)], f"request {i}"
    assert format_deploy([e.role for e in llm.engine.engines]) == chain[-1]
    for engine in llm.engine.engines:
        engine.scheduler.check_integrity()
        assert not engine.has_unfinished_requests()
        for pool in (engine.kv_manager, engine.image_manager):
            assert pool is None or pool.num_used_blocks == 0
    llm.shutdown()


def test_an_instance_sheds_what_it_no_longer_needs(tiny_llava_dir):
    llm = LLM(str(tiny_llava_dir), deploy="2EPD", devices="cpu:2", worker_processes=False)
    cluster = llm.engine
    cluster.redeploy(parse_deploy("1E+1PD"))
    assert not cluster.redeploying  # idle: the shrink happens at once
    e, pd = cluster.engines
    assert (e.role, pd.role) == ("E", "PD")
    assert e.kv_manager is None and e.runner.kv_cache is None and not e.model.has_language
    assert pd.model.has_vision is False and pd.image_manager is not None  # P reads images
    cluster.redeploy(parse_deploy("1EP+1D"))
    ep, d = cluster.engines
    assert ep.model.has_language and ep.kv_manager is not None and d.image_manager is None
    llm.shutdown()
