"""AgentScope 2.x, unchanged, through the runner's gateway: several agents in one episode,
each its own OpenAIChatModel pointed at its agent URL; every turn attributed to its agent,
trained flags as configured, the frozen model's turns recorded and never in the trainer's
batch. Then the thinking-text split the server applies (reasoning_content)."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from inference_helpers import NodeThread

from squall.inference.http.render import ReasoningSplit, split_reasoning
from squall.inference.tiny import build_tiny_model
from squall.runner.agents import LLM
from squall.runner.gateway import Gateway
from squall.shared.config import RunnerSection
from squall.shared.schemas import Trajectory
from squall.trainer.filters import decide_group
from squall.trainer.sequences import collate, token_weights, trajectory_to_samples

torch.set_num_threads(1)
SEATS = ["alice", "bob", "carol"]  # alice trains; bob plays the policy untrained; carol is the frozen rival


async def debate(task: dict, llm: LLM) -> float:
    """An ordinary AgentScope episode: three agents answer each other for two rounds."""
    from agentscope.agent import Agent
    from agentscope.credential import OpenAICredential
    from agentscope.message import Msg, TextBlock
    from agentscope.model import OpenAIChatModel

    agents = []
    for name in SEATS:
        model = OpenAIChatModel(
            credential=OpenAICredential(api_key=llm.api_key, base_url=llm.agent_url(name)),
            model="rival" if name == "carol" else llm.model,
            stream=name == "alice",  # one streaming agent: the gateway re-emits SSE chunks
            max_retries=0,
            parameters=OpenAIChatModel.Parameters(max_tokens=8),
        )
        agents.append(Agent(name=name, system_prompt=f"You are {name}. Argue briefly.", model=model))
    message = Msg(name="host", role="user", content=[TextBlock(text=task["question"])])
    for _ in range(2):
        for agent in agents:
            message = await agent.reply(message)
    return task["reward"]


async def _episodes(policy_url: str, rival_url: str) -> list[Trajectory]:
    section = RunnerSection(
        inference_urls=[policy_url], frozen_models={"rival": rival_url}, seats=SEATS, train_agents=["alice"]
    )
    gateway = Gateway(section, "policy")
    await gateway.start()
    out = []
    try:
        for index, reward in enumerate((1.0, 0.0)):
            attempt = gateway.open(f"g1:{index}#0")
            root = gateway.base_url(attempt.token).removesuffix("/v1")
            llm = LLM(base_url=f"{root}/v1", model="policy", api_key=f"squall-{attempt.token}", _root=root)
            got = await debate({"question": "Apples or pears?", "reward": reward}, llm)
            gateway.close(attempt.token)
            assert attempt.error is None
            out.append(Trajectory(
                run="t", task_id=f"g1:{index}", group_id="g1", sample_id="s", index=index, group_size=2,
                attempt=0, runner_id="r", status="ok", reward=got, turns=attempt.turns,
            ))  # fmt: skip
    finally:
        await gateway.stop()
    return out


@pytest.mark.slow
def test_an_agentscope_episode_is_attributed_and_only_trained_turns_reach_the_batch(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny")
    policy = NodeThread(model_dir).start()
    rival = NodeThread(model_dir, model_name="rival").start()  # its own endpoint, never trained
    try:
        trajectories = asyncio.run(_episodes(policy.url, rival.url))
    finally:
        rival.stop()
        policy.stop()
    for traj in trajectories:
        assert [t.agent for t in traj.turns] == SEATS * 2
        assert [t.model for t in traj.turns] == ["policy", "policy", "rival"] * 2
        assert [t.trained for t in traj.turns] == [True, False, False] * 2
        for turn in traj.turns:
            if turn.agent == "carol":  # recorded: which model, which version, no token ids asked of it
                assert turn.version == 0 and len(turn.response_tokens) == 0
            else:
                assert len(turn.response_tokens) == len(turn.logprobs) > 0 and turn.version == 0
    decision = decide_group("g1", trajectories, trainer_version=0, max_staleness=1, overlong="mask",
                            max_seq_len=4096)  # fmt: skip
    assert [t.key for t in decision.train] == [t.key for t in trajectories]
    for traj in decision.train:
        samples = trajectory_to_samples(traj, advantage=decision.advantages[traj.key])
        batch = collate(samples, token_weights(samples, "token"))
        targets = batch["targets"][batch["loss_mask"] > 0].tolist()  # (B, T-1) -> the trained targets
        alice = [int(x) for t in traj.turns if t.agent == "alice" for x in t.response_tokens]
        assert targets == alice  # bob's and carol's replies are never targets
        bob = [t for t in traj.turns if t.agent == "bob"]
        assert all(b.response_tokens.tolist() != alice[: len(b.response_tokens)] for b in bob)
        lp = batch["behaviour_logprobs"][batch["loss_mask"] > 0]
        expected = np.concatenate([t.logprobs for t in traj.turns if t.agent == "alice"])
        assert np.allclose(lp, expected)


# --- thinking text ------------------------------------------------------------------------------


def test_reasoning_split_whole_replies():
    assert split_reasoning("<think>add 2 and 2</think>4") == ("add 2 and 2", "4")
    assert split_reasoning("\n <think>plan\n</think>\n\nanswer") == ("plan\n", "\n\nanswer")
    assert split_reasoning("<think>cut off by max_tokens") == ("cut off by max_tokens", "")
    assert split_reasoning("no thinking here </think> at all") == (None, "no thinking here </think> at all")
    assert split_reasoning("") == (None, "")
    assert split_reasoning("<thin") == (None, "<thin")


def test_streamed_pieces_add_up_to_the_whole_split():
    rng = random.Random(0)
    words = ["<think>", "</think>", "<", "</", "think", ">", "a", " b", "\n", "<thi", "nk>", "</th", "ink>"]
    for _ in range(2000):
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 10)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 4))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        split, reasoning, content = ReasoningSplit(), "", ""
        for i, piece in enumerate(pieces):
            r, c = split.feed(piece, final=i == len(pieces) - 1)
            reasoning, content = reasoning + r, content + c
        whole_reasoning, whole_content = split_reasoning(text)
        assert (reasoning, content) == (whole_reasoning or "", whole_content), (text, pieces)
        assert split.found == (whole_reasoning is not None)
