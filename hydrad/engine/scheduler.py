"""Stage-level scheduling (HydraInfer, Algorithm 1), context-aware, with pull-based migration.

Each step fills one batch, in this order, while the step's *predicted* latency stays
within the instance's bound (``StepBudget``; ``latency_model.latency_bound``: TBT for
roles that decode, alpha * TTFT otherwise, each less the SLO's headroom; a step that
carries no decode keeps no stream waiting, so it takes the ``idle_bound``, alpha * TTFT
less the headroom, whatever the role; ``token_budget``/``image_budget`` are hard caps on
top):

1. running decodes (one token each, at their own KV context);
2. unfinished prefill chunks, each cut to the largest size that fits (a chunk may
   stop anywhere, inside image tokens too);
3. unfinished encodes (images of admitted requests);
4. requests migrating in from another instance (the head of the queue): blocks are
   allocated here and the copy from the source's pool is handed to the copy thread;
5. new requests, first come first served: those with images are admitted to
   encoding (image blocks for all their images are taken at once, so two requests
   can never each hold half of what they need), text-only ones straight to prefill.

Prompts are of two kinds (``Request.long_prompt``): long where the whole prompt's work
here, predicted alone, passes the step bound (a long text, a video), short where one step
could carry it. While both kinds wait, steps 2, 3 and 5 run for the short prompts first,
within ``1 - long_prompt_share`` of the room the decodes left, then for the long ones up to
the bound: a text prompt arriving behind a video is prefilled in the next step instead of
after the video's encode and prefill, and a long prompt keeps at least its share of every
step however many short ones come; a step without decodes that gives a short prompt its
first token keeps the long ones to the decodes' bound rather than the ``idle_bound``.
Within a kind the order is first come first served, and a request of the other kind passed
over at admission keeps the slot, image blocks and KV blocks it waits for (``_admit_new``).
With one kind waiting, or a share of 1, steps are built as above. (vLLM's
``max_long_partial_prefills`` lets short prompts jump the queue the same way, by token
counts; here the split is by predicted time.)

With prefix caching (on the KV pool of an instance that prefills: ``BlockManager``,
``prefix_cache``), each full block a prefill completes is registered under a digest of
the tokens and images it depends on, and so is every full block a request holds when it
leaves (finished, preempted, handed on). A new request first takes the longest run of
its blocks found registered (never its last token: that one samples) and starts its
prefill after them; its images that lie wholly inside need no encoding (one the run ends
inside is encoded, and prefill reads the rest of its features). A new request whose next
blocks another admitted here is computing, a run of at least half of what it would compute,
waits for them and finds them registered (``_waits_for_prefix``): the ``n`` completions of
one prompt prefill it once; requests behind it go first meanwhile (an image offered by an
E instance stays unpulled meanwhile). A request whose images
were encoded elsewhere takes its run when they arrive. A preempted request finds its own
blocks again unless they were needed meanwhile. The image pool of an instance that encodes
is a cache the same way (``_found_images``): an image encoded here is registered under its
content and found by any later request with it, wherever in the prompt; found images are
not encoded (a request whose every image is found, on an instance that only encodes, is
offered at once), and a request whose next image is being encoded here waits for it
(``_waits_for_image``).

A step that carries decodes is also kept within each stream's deadline: the next token
of a stream that was not in the step before (migrated in after its first token, or
waiting here) is due one bound after its previous one, so the step is filled only to
what the most pressed of them has left (``_bound_by_deadlines``). While decodes are
handed over from another instance, every step also leaves room under its bound for the
next one's first step here (``_bound_for_handoffs``). Time is read from ``clock`` (the
planner's simulator passes its virtual one).

The first unit of work of an empty step is always admitted, so a step makes progress
even when the bound cannot be met. An image (or a video's group of frames: the unit cannot
be cut) too long to fit beside the step's decodes alone would wait for as long as decodes
keep coming: after ``OVERRUN_STEPS`` steps in a row with one, a step may go past its bound,
up to ``OVERRUN_FACTOR`` times it, for such images (at least one), and the next such step
comes no sooner than ``OVERRUN_STEPS`` later, so a stream that stays sees at most one gap in
that many past its bound (``SchedulerOutput.overrun``; its p90 TBT holds). The SLO bounds
each stream's p90 gap, not every gap: while a long prompt waits, a step may take the TTFT
share (the ``idle_bound``) for the long prompts when every stream decoding in it could have
one more gap past the TBT and still meet its p90, counted over the gaps it has had, as if it
ended after this step (``tbt_slack``, ``gaps_past_p90``, ``SchedulerOutput.slack``). Steps are
filled to the bound over the p90 of their recent measured / predicted time, so one in ten
runs over it; a stream that has no gap past the bound left to spend within its p90, over
the length a request finished here typically has, cannot take one more: while one decodes
here, the prompt work of each step (not its decodes: a stream left out of a step has a long
gap whatever) is filled to the bound over a higher quantile instead (``tbt_guard``,
``_guarded``). A request's
prefill starts only after all its images are encoded: in a later step, or, where the step's
language work runs after its vision work (``prefill_after_encode``: no dual streams), in the
step that encodes the last of them, with what is left of its bound. A stage this instance does not hold is
offered to another instance: the request keeps its blocks until the target has pulled
them. An instance that only decodes pulls a stream handed over after its first token only
when its next step can carry that stream's decode within the bound (``_decode_budget``), and
the instance that sampled the first token admits no new prompt while one it handed over has
waited past the TBT (``handoff_wait``) to be taken (``_hold_new``): with the decodes' steps
full, new prompts wait before their first token rather than between their first and second.
When the KV pool runs dry, the latest-admitted running request not yet in this
batch is preempted: it gives back everything and is recomputed later from its prompt and
the tokens it has produced.

Queues are insertion-ordered dicts, so leaving one is O(1) and a step costs a pass
over the requests it schedules. The scheduler imports no torch: it is tested with
synthetic outputs and synthetic latency models.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from hydrad.config import SchedulerConfig
from hydrad.engine.block_manager import BlockManager
from hydrad.engine.latency_model import LatencyModel, StepBudget
from hydrad.engine.migration import Pull
from hydrad.engine.prefix_cache import block_digests, image_block_digests
from hydrad.engine.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING
# Seconds after a decode was last handed over from another instance during which steps
# leave room for the next one (``Scheduler._bound_for_handoffs``).
HANDOFF_WINDOW = 10.0
# The least share of the step bound such a step keeps for prefills and encodes.
HANDOFF_SHARE = 0.5
# Seconds after a first token handed over last waited past ``handoff_wait`` to be taken
# during which the instance's steps keep to ``handoff_wait`` (``_handoffs_behind``).
BEHIND_WINDOW = 2.0
# Steps without a step for the prompts, while decodes are handed over here, after which each
# step advances the oldest of them by one unit past its bound if need be (``_starved``).
STARVED_STEPS = 4
# An image (or a video's group) too long to fit beside a step's decodes alone waits while
# decodes keep coming; after this many steps in a row with one, a step may go past its bound,
# up to OVERRUN_FACTOR times it, for such images (at least one), and then not again for as
# many steps: each stream that stays gets at most one gap in OVERRUN_STEPS past its bound (its
# p90 TBT holds), where such a video waited for every stream to end (``_add_image``).
OVERRUN_STEPS = 16
OVERRUN_FACTOR = 2.0
# Finished requests whose gaps between tokens make a stream's expected length (``_allowance``).
LENGTH_WINDOW = 64
# An image the simulator replays as found in an image cache (``Scheduler._replayed_images``):
# its blocks are taken fresh.
REPLAYED: list[int] = [-1]


@dataclass
class SchedulerOutput:
    # (request, image index): images to encode into their image-cache blocks.
    encodes: list[tuple[Request, int]] = field(default_factory=list)
    # (request, num_new_tokens): decodes first, then prefill chunks.
    chunks: list[tuple[Request, int]] = field(default_factory=list)
    pulls: list[Pull] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that left the running set since the last schedule (finished, aborted,
    # preempted, offered): the runner drops their batch rows before this step.
    dropped: list[Request] = field(default_factory=list)
    # Predicted seconds of the vision and the language work (0 without a latency model).
    predicted_vision: float = 0.0
    predicted_language: float = 0.0
    predicted_prefill: float = 0.0  # the prefill terms of predicted_language
    # The first chunks are this many decodes.
    num_decodes: int = 0
    # The step goes past its bound for images that could not fit beside its decodes
    # (``OVERRUN_STEPS``).
    overrun: bool = False
    # The step goes past the TBT bound for long prompts, on its streams' slack (``tbt_slack``).
    slack: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.encodes and not self.chunks and not self.pulls

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


@dataclass
class LanguageResult:
    """What one language step produced, as columns: one new token per listed request."""

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Index of each emitted token in the runner's sampled list (for its logprobs).
    sample_index: list[int] = field(default_factory=list)
    # Requests that finished in this step (their finish_reason is set).
    finished: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: BlockManager | None,
        image_manager: BlockManager | None,
        max_model_len: int,
        role: str = "EPD",
        clock=time.monotonic,
        prefix_caching: bool = False,
        replay_cached: bool = False,
        prefill_after_encode: bool = False,
    ):
        self.config = config
        # The step's language work runs after its vision work, on the same thread (a CPU
        # without dual streams): a request whose last images are encoded in a step may
        # start its prefill in that same step, reading the features just written.
        self.prefill_after_encode = prefill_after_encode
        # Seconds, system-wide (the planner's simulator passes its virtual clock).
        self.clock = clock
        self.kv = kv_manager
        self.images = image_manager
        self.max_model_len = max_model_len
        self.role = role
        # Stages being handed over (a redeploy takes them away): their work goes elsewhere.
        self.retiring = ""
        self.can_decode = "D" in role
        self.can_prefill = "P" in role
        self.waiting: deque[Request] = deque()
        self.incoming: deque[Request] = deque()  # migrating in, not yet admitted
        self.encoding: dict[str, Request] = {}
        # Every running request, in admission order (the preemption order); the same
        # requests split by what their next step is.
        self.running: dict[str, Request] = {}
        self.decoding: dict[str, Request] = {}
        self.prefilling: dict[str, Request] = {}
        self.pulling: dict[str, Request] = {}
        self.offered: dict[str, Request] = {}
        # The offered requests whose first token was sampled here and whose decodes another
        # instance is to take, by id: when each was offered (``clock``), oldest first.
        self._first_tokens_offered: dict[str, float] = {}
        self.requests: dict[str, Request] = {}
        # (request, kind) offered since the engine last looked; the engine drains it.
        self.new_offers: list[tuple[Request, str]] = []
        self.num_preemptions = 0
        self.num_overrun_steps = 0
        self.num_slack_steps = 0
        self.num_guarded_steps = 0
        self.num_held_steps = 0
        self._dropped: list[Request] = []
        self._step = 0
        self.latency_model: LatencyModel | None = None
        self.latency_bound = 0.0
        self.idle_bound = 0.0
        # Seconds a first token handed over may wait to be taken before new prompts wait here
        # (``_hold_new``); inf: never.
        self.handoff_wait = math.inf
        self._hold_new = False
        self._behind_until = -math.inf  # (``clock``) while its steps keep to ``handoff_wait``
        # When the last decode handed over from another instance arrived (``clock``).
        self._last_handoff = -math.inf
        # The last step that advanced a prompt (an image encoded, a chunk prefilled), or that
        # had none to advance; and whether this step still owes one (``_starved``).
        self._prompt_step = 0
        self._force_one = False
        self._forced = False  # this step's prompt unit went past the bound only by ``_force_one``
        # Images that cannot fit beside the decodes (``OVERRUN_STEPS``): the first step of the
        # current run of steps with one (None: the last step had none), whether this step met
        # one, the last step that went past its bound for them, and whether this one may.
        self._stuck_since: int | None = None
        self._stuck = False
        self._last_overrun = -OVERRUN_STEPS
        self._overrun = False
        self._decode_language = 0.0  # the predicted language seconds of this step's decodes
        # Measured / predicted length of recent steps with decodes (``latency_model.Calibration``):
        # its p90, and the higher quantile a guarded step is filled by; this step's.
        self.calibration = self.guard_calibration = self._step_calibration = 1.0
        # The streams decoding here with no gap past the bound left to spend within their p90
        # over their expected length (``_guarded``), by id, in the order they spent it.
        self._spent: dict[str, Request] = {}
        # Gaps between tokens of the requests that finished here lately (their last
        # ``LENGTH_WINDOW``), and their median: a stream's expected length (``_allowance``).
        self._gaps_seen: deque[int] = deque(maxlen=LENGTH_WINDOW)
        self._num_finished = 0
        self._typical_gaps = 0
        # Smallest prefill chunk an empty step takes when nothing fits the bound.
        self.min_chunk = kv_manager.block_size if kv_manager is not None else 1
        self.prefix_caching = prefix_caching
        # The planner's simulator: a request that arrives with ``num_cached_tokens`` (what it found
        # cached when it was traced) starts its prefill after that many tokens, in blocks taken
        # fresh (``_admit_new``); its requests carry shapes, not content, to look up.
        self.replay_cached = replay_cached
        self._caching = False  # prefix caching on, and this instance prefills into a KV pool
        self._update_caching()
        # Tokens of the requests that looked for a cached prefix, the tokens found, and the
        # images that needed no encoding for it.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.images_cached = 0
        # The full prompt blocks that requests admitted here compute and have not registered
        # yet, by digest (``_note_computing``): a new prompt whose next uncached block is one
        # of them waits for it (``_waits_for_prefix``). An entry goes when its block is
        # registered or its request leaves its prefill (``_forget_computing``). In the planner's
        # simulator (``replay_cached``), whose requests carry shapes, not content, the entries
        # are groups instead: the one of a prompt's completions that computes it, until its
        # prefill ends; the others wait for it (``_waits_for_group``).
        self._computing: dict[bytes | str, Request] = {}
        # The same for images (the image cache, ``_found_images``): by content digest, the
        # images that requests admitted here encode and have not registered yet; a new request
        # whose first image to encode is one of them waits for it (``_waits_for_image``).
        self._encoding_images: dict[bytes, Request] = {}

    # -- role changes (live redeploy) ----------------------------------------------------------
    def set_role(self, role: str, kv_manager: BlockManager | None, image_manager: BlockManager | None) -> None:
        """Run the stages of ``role`` with these pools from the next step on (a stage that
        stays must keep its pool: requests hold blocks of it)."""
        self.role = role
        self.kv, self.images = kv_manager, image_manager
        self.retiring = "".join(s for s in self.retiring if s in role)
        self.can_decode = "D" in role and "D" not in self.retiring
        self.can_prefill = "P" in role and "P" not in self.retiring
        if kv_manager is not None:
            self.min_chunk = kv_manager.block_size
        self._update_caching()

    def retire(self, stages: str) -> None:
        """Hand ``stages`` over: from now on a request whose next stage is one of them is
        offered to another instance, and running decodes go at once (their KV is complete).
        Work already started in a retiring stage finishes its stage here."""
        self.retiring = "".join(s for s in stages if s in self.role)
        self.can_decode = "D" in self.role and "D" not in self.retiring
        self.can_prefill = "P" in self.role and "P" not in self.retiring
        self._update_caching()
        if "D" in self.retiring:
            for req in list(self.decoding.values()):
                self._offer(req, "kv")
        self._hand_off_waiting()
        self._forward_incoming()

    def _hand_off_waiting(self) -> None:
        """Requests that have not started and whose first stage is retiring move whole."""
        for req in [r for r in self.waiting if not self._runs_first_stage(r)]:
            self._leave_queue(req)
            self._move_whole(req)

    def _move_whole(self, req: Request) -> None:
        """``req``, out of its queue and holding nothing here, goes to another instance as if
        it had not started: its prompt, its images' pixels and the tokens it generated."""
        req.num_computed_tokens = req.num_encoded_images = 0
        req.num_cached_tokens = None  # looked up again where it goes
        self._finish(req, "migrated")
        self.new_offers.append((req, "prompt"))

    def _forward_incoming(self) -> None:
        """Offers received for a stage that is being handed over here and not pulled yet go on
        as they came, their blocks still at their source: pulled here first, each would wait
        for room, and two instances that hand a stage to each other during a redeploy can
        each hold the room the other's pulls wait for, forever. (Their source may run the
        stage again by now: it then takes them back, ``reclaim``.)"""
        stage_of = {"image": "P", "kv": "D"}
        for req in [r for r in self.incoming if stage_of[r.pull[0]] in self.retiring]:
            self._leave_queue(req)
            self._finish(req, "migrated")
            self.new_offers.append((req, "forward"))

    def reclaim(self, req_id: str) -> bool:
        """An offer of this instance came back to it (it runs the offered stage again, after a
        redeploy): the request goes on here from the blocks it holds, nothing copied. False if
        it is no longer offered here (aborted meanwhile)."""
        req = self.offered.pop(req_id, None)
        if req is None:
            return False
        self._first_tokens_offered.pop(req_id, None)
        req.mark("reclaimed")
        self._start_running(req)
        return True

    def _runs_first_stage(self, req: Request) -> bool:
        """Whether ``req``'s first stage (E with images, else P) runs here: in the role, and not
        being handed over."""
        stage = self._first_stage(req)
        return stage in self.role and stage not in self.retiring

    def _update_caching(self) -> None:
        self._caching = self.prefix_caching and self.kv is not None and self.can_prefill
        if not self._caching and not self.replay_cached:
            self._computing = {}
        # The image cache: on the image pool of an instance that encodes.
        self._image_caching = (self.prefix_caching and self.images is not None and "E" in self.role
                               and "E" not in self.retiring)
        if not self._image_caching:
            self._encoding_images = {}

    @staticmethod
    def _first_stage(req: Request) -> str:
        return "E" if req.images else "P"

    def drained(self, keep_kv: bool, keep_images: bool) -> bool:
        """Nothing here needs a retiring stage any more, and a pool that is to go holds no block."""
        r = self.retiring
        if self.kv is not None and not keep_kv and self.kv.num_used_blocks:
            return False
        if self.images is not None and not keep_images and self.images.num_used_blocks:
            return False
        queued = list(self.waiting) + list(self.incoming) + list(self.pulling.values())
        if "E" in r and (self.encoding or any(q.images and not q.images_done and q.pull is None for q in queued)):
            return False
        if "P" in r and (self.prefilling or any(q.pull is not None and q.pull[0] == "image" for q in queued)
                         or any(not q.images and q.pull is None for q in queued)):
            return False
        if "D" in r and (self.decoding or any(q.pull is not None and q.pull[0] == "kv" for q in queued)):
            return False
        return True

    def set_latency_model(self, model: LatencyModel | None, bound: float, idle_bound: float | None = None,
                          handoff_wait: float | None = None) -> None:
        """Fill steps by predicted latency up to ``bound`` seconds (None: caps only), and a
        step without decodes up to ``idle_bound`` (at least ``bound``; None: ``bound``);
        admit no new prompt while a first token handed over has waited ``handoff_wait``
        seconds to be taken (None: never hold them)."""
        if model is not None and bound <= 0:
            raise ValueError(f"latency bound must be > 0 seconds, got {bound}")
        self.latency_model = model
        self.latency_bound = bound
        self.idle_bound = max(bound, idle_bound or 0.0)
        self.handoff_wait = math.inf if handoff_wait is None else handoff_wait
        for req in self.requests.values():
            self._classify(req)

    def set_calibration(self, factor: float, guard: float | None = None) -> None:
        """Steps that carry decodes run ``factor`` times their prediction now (their p90): fill
        them to the bound divided by it; a guarded step (``_guarded``) to the bound divided by
        ``guard`` (a higher quantile; None: ``factor``)."""
        if factor <= 0 or (guard is not None and guard <= 0):
            raise ValueError(f"calibration factors must be > 0, got {factor} and {guard}")
        self.calibration = factor
        self.guard_calibration = max(factor, guard or factor)

    # -- admission ---------------------------------------------------------------------
    def check_fits(self, req: Request) -> None:
        """Refuse (ValueError) a request that could never run here, even alone."""
        if req.images and "E" not in self.role and req.pull is None:
            raise ValueError(f"a {self.role} instance cannot encode images")
        if not req.images and "P" not in self.role and req.pull is None:
            raise ValueError(f"a {self.role} instance cannot prefill")
        if self.kv is not None:
            need = self.kv.num_blocks_for(min(self.max_model_len, req.max_num_tokens))
            if need > self.kv.num_blocks:
                raise ValueError(
                    f"request needs {need} KV blocks for {req.max_num_tokens} tokens but the KV cache holds "
                    f"{self.kv.num_blocks}; lower max_tokens or enlarge the cache"
                )
        if req.images and self.images is not None:
            need = self._image_blocks_needed(req)
            if need > self.images.num_blocks:
                raise ValueError(
                    f"request's {req.num_images} images need {need} image-cache blocks, the cache holds "
                    f"{self.images.num_blocks}"
                )

    def add(self, req: Request, front: bool = False) -> None:
        """Queue ``req`` (at the head with ``front``: it has waited elsewhere already)."""
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.check_fits(req)
        self.requests[req.req_id] = req
        self._classify(req)
        queue = self.incoming if req.pull is not None else self.waiting
        queue.appendleft(req) if front else queue.append(req)
        if req.pull is not None and req.pull[0] == "kv" and req.output_token_ids:
            self._last_handoff = self.clock()

    def abort(self, req_id: str) -> Request | None:
        req = self.requests.get(req_id)
        if req is None:
            return None
        if req.status is RequestStatus.PULLING:
            # The copy thread is writing into its blocks: they are freed when it is done.
            self.requests.pop(req_id)
            req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
            return req
        self._remove(req)
        self._finish(req, "abort")
        return req

    def release(self, req_id: str) -> None:
        """The target of an offer has copied its blocks: let them go."""
        req = self.offered.get(req_id)
        if req is not None:
            self._remove(req)
            self._finish(req, "migrated")

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        """Anything a step can advance (offered requests only wait for their target)."""
        return bool(self.waiting or self.incoming or self.encoding or self.running or self.pulling)

    # -- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step += 1
        if self.retiring:  # preempted meanwhile, or offered before the retire: on to another instance
            self._hand_off_waiting()
            self._forward_incoming()
        # Requests that leave the running set while this step is built (preempted) are
        # dropped before it runs too: one may be admitted again within this very step.
        out = SchedulerOutput(dropped=self._dropped)
        self._step_calibration = self.calibration
        bound = self.latency_bound / self.calibration if self.latency_model is not None else 0.0
        budget = StepBudget(self.latency_model, bound, self.config.token_budget, self.config.image_budget)
        pressed = self._schedule_decodes(out, budget)
        out.num_decodes = len(out.chunks)
        if self._spent and out.num_decodes and self._guarded():
            # The decodes are in; the rest of the step (prompts) fills to the guarded bound.
            self._step_calibration = self.guard_calibration
            bound = self.latency_bound / self.guard_calibration
            budget.set_bound(min(budget.bound, bound))
            self.num_guarded_steps += 1
        # The clock is read only on instances that decodes were ever handed to.
        handoffs = (self.latency_model is not None and self._last_handoff > -math.inf
                    and self.clock() - self._last_handoff < HANDOFF_WINDOW)
        if budget.empty and self.idle_bound > bound and not handoffs:
            # No stream waits on this step: prefill and encode may take the TTFT share.
            budget.set_bound(self.idle_bound)
        elif pressed and self.latency_model is not None:
            self._bound_by_deadlines(pressed, budget)
        if handoffs:
            self._bound_for_handoffs(bound, budget)
        self._force_one, self._forced = handoffs and self._starved(), False
        self._hold_new, behind = self._handoffs_behind()
        self.num_held_steps += self._hold_new and bool(self.waiting)  # a prompt it could have admitted
        if behind and self.handoff_wait < budget.bound:
            budget.set_bound(self.handoff_wait)
        self._decode_language, self._stuck = budget.language, False
        self._overrun = (self._stuck_since is not None and self._step - self._stuck_since >= OVERRUN_STEPS
                         and self._step - self._last_overrun >= OVERRUN_STEPS)
        short, long = self._waiting_kinds()
        # Long prompts wait and every stream can take a gap past the TBT: they may take the
        # TTFT share, as a step without decodes does.
        slack = (long and out.num_decodes and not handoffs and self.config.tbt_slack
                 and self.idle_bound > max(self.latency_bound, budget.bound) and self._streams_have_slack(out))
        if short and long and self.config.long_prompt_share < 1.0:
            # Prompts one step carries go first, within (1 - long_prompt_share) of the room
            # the decodes left; the long ones then take what is left, at least their share.
            room, floor = budget.bound, budget.predicted()
            if room > floor:
                budget.set_bound(floor + (1.0 - self.config.long_prompt_share) * (room - floor))
            self._schedule_prompts(out, budget, long=False)
            first_token = any(r.num_computed_tokens + n == r.num_tokens for r, n in out.chunks[out.num_decodes:])
            if slack and not first_token:
                room = self.idle_bound
            elif room > bound and first_token:
                # A prompt's first token comes at this step's end: the long prompts keep it to
                # the decodes' bound instead of the TTFT share an idle step takes.
                room = max(bound, budget.predicted())
            budget.set_bound(room)
            self._schedule_prompts(out, budget, long=True)
        else:
            if slack and not short:
                budget.set_bound(self.idle_bound)
            self._schedule_prompts(out, budget)
        out.slack = bool(slack) and budget.predicted() > bound
        self.num_slack_steps += out.slack
        if not self._stuck:
            self._stuck_since = None
        elif self._stuck_since is None:
            self._stuck_since = self._step
        out.overrun = self._last_overrun == self._step
        self.num_overrun_steps += out.overrun
        # Starved prompts take a unit every step until one is advanced within the bound again.
        if (((out.encodes or len(out.chunks) > out.num_decodes) and not self._forced)
                or not (self.prefilling or self.encoding or self.waiting)):
            self._prompt_step = self._step
        out.predicted_vision, out.predicted_language = budget.vision, budget.language
        out.predicted_prefill = budget.prefill
        self._dropped = []
        return out

    def _schedule_prompts(self, out: SchedulerOutput, budget: StepBudget, long: bool | None = None) -> None:
        """Algorithm 1's prompt work, in its order: prefill chunks, encodes, migrating requests,
        new requests, and (``prefill_after_encode``) the first chunks of the prompts whose last
        images this step encodes; ``long``: only the prompts of that kind
        (``Request.long_prompt``; migrating requests are admitted in the first pass)."""
        self._schedule_prefills(out, budget, long)
        for req in list(self.encoding.values()):
            if long is None or req.long_prompt is long:
                self._schedule_images(req, budget, out)
        if long is not True:
            self._admit_incoming(out)
        if (not self.incoming or self._waited_longer()) and not self._hold_new:
            self._admit_new(out, budget, long)
        if self.prefill_after_encode and out.encodes and self.can_prefill and "P" not in self.retiring:
            self._prefill_encoded(out, budget)

    def _classify(self, req: Request) -> None:
        """Whether ``req``'s prompt is long: its whole work here (the images it still needs
        encoded, its prefill), predicted alone, passes the step bound (``long_prompt_share``)."""
        m = self.latency_model
        req.long_prompt = m is not None and m.prompt_seconds(
            req.images, req.num_tokens, encode="E" in self.role and not req.images_done,
            prefill="P" in self.role, priced=req.prompt_logprobs is not None) > self.latency_bound

    def _waiting_kinds(self) -> tuple[bool, bool]:
        """Whether short prompts (one step's), and long ones, wait for this step's room; a
        scan that stops once it has met both."""
        if self.latency_model is None:
            return False, False
        short = long = False
        for queue in (self.prefilling.values(), self.encoding.values(), self.waiting):
            for req in queue:
                if req.long_prompt:
                    long = True
                else:
                    short = True
                if short and long:
                    return True, True
        return short, long

    def _streams_have_slack(self, out: SchedulerOutput) -> bool:
        """Whether every stream decoding in this step can take one gap past the TBT and still
        have its p90 gap within it, counted over the gaps it will have had after this step (as
        if it ended then: however soon it ends, it meets its p90). A gap counts as past the
        TBT from the step bound on (``num_long_gaps``): the p90 of a stream that spent its
        slack is its longest other gap, which the bound's headroom keeps within the TBT as
        the client sees it."""
        for req, _ in out.chunks[:out.num_decodes]:
            # Before this step it has num_output_tokens tokens: after it, as many gaps.
            if req.num_long_gaps >= gaps_past_p90(req.num_output_tokens):
                return False
        return True

    def _allowance(self, req: Request) -> int:
        """Gaps past the bound ``req``'s p90 allows over its expected length: the gaps it has
        had, or, if more, those of a typical request finished here (the median of the last
        ``LENGTH_WINDOW``), at most its ``max_tokens``'."""
        expected = min(req.sampling_params.max_tokens - 1, self._typical_gaps)
        return gaps_past_p90(max(req.num_output_tokens - 1, expected))

    def _spend(self, req: Request) -> None:
        """``req`` just had a gap past the bound: with none left to spend, the steps it is in
        are guarded (``_guarded``)."""
        if self.config.tbt_guard and req.num_long_gaps >= self._allowance(req):
            self._spent[req.req_id] = req

    def _guarded(self) -> bool:
        """Whether a stream decoding here has no gap past the bound left to spend within its
        p90 over its expected length (``_allowance``): one more would break its SLO. This
        step is then filled to the bound over ``guard_calibration`` (a higher quantile of the
        steps' measured / predicted time than the p90 that fills the others), so that it
        ends within the bound all but rarely. A stream leaves ``_spent`` when it leaves the
        running decodes (``_leave_queue``), or here once its expected length has grown to
        allow one more: the oldest are looked at until one is still spent, so a step costs
        one look while the streams stay spent."""
        spent = self._spent
        while spent:
            req = next(iter(spent.values()))
            if req.num_long_gaps >= self._allowance(req):
                return True
            del spent[req.req_id]
        return False

    def _count_length(self, req: Request) -> None:
        """A request finished here: its gaps count towards a stream's expected length
        (``_allowance``; the median is taken again every ``LENGTH_WINDOW // 4`` requests)."""
        gaps = req.num_output_tokens - 1
        if gaps < 1:
            return
        self._gaps_seen.append(gaps)
        self._num_finished += 1
        if self._num_finished % (LENGTH_WINDOW // 4) == 0 or self._num_finished < LENGTH_WINDOW // 4:
            ordered = sorted(self._gaps_seen)
            self._typical_gaps = ordered[len(ordered) // 2]

    def _handoffs_behind(self) -> tuple[bool, bool]:
        """Whether a first token sampled here has waited more than ``handoff_wait`` for the
        instance it was handed over to to take its decodes (``_first_tokens_offered``): that
        instance's steps are full, and each new prompt prefilled here would wait there
        too, between its first token and its second. New prompts then wait here, before
        their first token, until it catches up; prompts already admitted go on. And whether
        one did within ``BEHIND_WINDOW`` seconds: the steps here then keep to
        ``handoff_wait``, so that the first tokens come a few at a time, as the decode
        instance takes them, instead of a whole long step's worth at once when the hold
        ends (that instance, not this one, bounds the throughput meanwhile)."""
        if not self._first_tokens_offered and self._behind_until == -math.inf:
            return False, False
        now = self.clock()
        oldest = next(iter(self._first_tokens_offered.values()), now)
        if now - oldest > self.handoff_wait:
            self._behind_until = now + BEHIND_WINDOW
            return True, True
        if now >= self._behind_until:
            self._behind_until = -math.inf
            return False, False
        return False, True

    def _decode_budget(self) -> StepBudget:
        """The next step of this instance as the decodes it holds and those it is pulling make
        it (each at its context), for the first tokens handed over to fill (``add_decode``:
        with no decode here the first one is taken whatever it costs, as a step makes
        progress even when the bound cannot be met)."""
        pulled = [r.pull[3] + 1 for r in self.pulling.values() if r.pull[0] == "kv"]
        # Filled as the last step was (a guarded one while a stream here has spent its gaps).
        budget = StepBudget(self.latency_model, self.latency_bound / self._step_calibration, self.config.token_budget,
                            self.config.image_budget)
        budget.add_decodes(len(self.decoding) + len(pulled),
                           sum(r.num_computed_tokens + 1 for r in self.decoding.values()) + sum(pulled))
        return budget

    def _starved(self) -> bool:
        """Whether the prompts here have had no step for ``STARVED_STEPS`` steps (called while
        decodes are handed over to this instance): this step then advances the oldest of them
        by one unit (an image, a ``min_chunk``) past its bound if need be (``_fit_prefill``,
        ``_add_image``). Decodes that other instances keep sending can fill every step for as
        long as they keep prefilling: an instance that prefills and also decodes for others
        (``1EP+1EPD``), or one handing E or P over in a redeploy to the instance that sends it
        decodes (the prompt it was to finish held a hand-over five minutes under 64 streams).
        Its own decodes alone cannot do that: it admits none while they fill its steps."""
        return self._step - self._prompt_step > STARVED_STEPS

    def _fit_prefill(self, budget: StepBudget, start: int, num_tokens: int, priced: bool) -> int:
        """``budget.fit_prefill``, or, where nothing fits and the prompts are starved
        (``_force_one``), a ``min_chunk`` past the bound; a chunk given takes the step's force."""
        want = budget.fit_prefill(start, num_tokens, self.min_chunk, priced=priced)
        if want == 0 and self._force_one:
            want = budget.fit_prefill(start, num_tokens, self.min_chunk, force=True, priced=priced)
            self._forced = want > 0
        if want:
            self._force_one = False
        return want

    def _add_image(self, budget: StepBudget, image) -> bool:
        """``budget.add_image``, or past the bound where the prompts are starved, as
        ``_fit_prefill``, or, for an image that cannot fit beside the step's decodes alone, up
        to ``OVERRUN_FACTOR`` times the bound in a step allowed to (``OVERRUN_STEPS``)."""
        if budget.add_image(image.num_patches, image.length, span=image.attention_span):
            self._force_one = False
            return True
        if self._force_one and budget.add_image(image.num_patches, image.length, force=True, span=image.attention_span):
            self._force_one, self._forced = False, True
            return True
        m = self.latency_model
        if m is None or budget.images_left < 1 or not self._decode_language:
            return False  # without decodes, an empty step takes it
        alone = m.v_fixed + m.image_seconds(image.num_patches, image.length, image.attention_span)
        if m.combine(alone, self._decode_language) <= budget.bound:
            return False  # it would fit beside the decodes: it waits for room, not for them
        self._stuck = True
        if not self._overrun:
            return False
        bound = budget.bound
        budget.set_bound(OVERRUN_FACTOR * self.latency_bound / self._step_calibration)
        first = self._last_overrun != self._step
        added = budget.add_image(image.num_patches, image.length, force=first, span=image.attention_span)
        budget.set_bound(bound)
        if added:
            self._last_overrun = self._step
        return added

    def _bound_for_handoffs(self, bound: float, budget: StepBudget) -> None:
        """A stream handed over from another instance after its first token is pulled between
        steps: arriving while a step runs, it waits for that step's end, then for its own
        first step here, and that gap can miss the TBT on its own (for a short answer it is
        the p90). While decodes arrive that way (one within ``HANDOFF_WINDOW`` seconds),
        each step leaves room under the bound for that first step: the decodes it carries
        and one more (without decodes: the TTFT share is not taken either). The step keeps
        at least ``HANDOFF_SHARE`` of the bound for other work, so that many decodes do
        not stop prefills."""
        m = self.latency_model
        first_step = budget.predicted() + m.l_decode + m.l_ctx  # one more decode at 1k context
        if budget.empty:
            first_step += m.l_fixed
        budget.set_bound(min(budget.bound, max(bound - first_step, HANDOFF_SHARE * bound)))

    def _schedule_decodes(self, out: SchedulerOutput, budget: StepBudget) -> list[float]:
        """Admit the running decodes; returns when the previous token of each admitted stream
        that was not in the step before was sampled (``_bound_by_deadlines``)."""
        chunks = out.chunks
        step = self._step
        pressed = []
        bs = self.kv.block_size if self.kv is not None else 0
        for req in list(self.decoding.values()):
            if req.status is not _RUNNING:  # preempted earlier in this pass
                continue
            num_slots = req.num_computed_tokens + 1
            if not budget.add_decode(num_slots):
                break
            if num_slots > len(req.kv_block_ids) * bs and not self._reserve_kv(req, num_slots, out):
                budget.undo_decode(num_slots)  # not run after all
                continue
            chunks.append((req, 1))
            if req.scheduled_step != step - 1 and req.last_token_time is not None:
                pressed.append(req.last_token_time)
            req.scheduled_step = step
        return pressed

    def _bound_by_deadlines(self, pressed: list[float], budget: StepBudget) -> None:
        """Each stream's next token is due ``latency_bound`` after its previous one. A stream
        that was in the step before gets its token one step and the time between steps
        later, which the bound's headroom covers. One whose previous token came from
        elsewhere (``pressed``: when it was sampled on another instance before a migration,
        or before a wait here) may have less left: the step is filled only to what the most
        pressed of them has left, unless even the decodes alone cannot make that one's
        deadline (its gap is lost whatever this step carries)."""
        floor = budget.predicted()  # the decodes alone
        # Latest sampling time at which a stream's deadline still leaves room for the decodes.
        cal = self._step_calibration
        cutoff = self.clock() - self.latency_bound + floor * cal
        live = [t for t in pressed if t >= cutoff]
        if live:
            left = (min(live) - cutoff) / cal + floor
            if left < budget.bound:
                budget.set_bound(left)

    def _schedule_prefills(self, out: SchedulerOutput, budget: StepBudget, long: bool | None = None) -> None:
        """The prompts being prefilled (``long``: those of that kind), each its largest chunk
        that fits (the oldest at least a ``min_chunk`` where they are starved: ``_starved``)."""
        for req in list(self.prefilling.values()):
            if budget.tokens_left < 1:
                return
            if req.status is not _RUNNING or (long is not None and req.long_prompt is not long):
                continue
            if not req.preemptible and not self._reserve_kv(req, self._full_len(req), out):
                # It cannot be recomputed here, so it never waits on KV mid-way: it holds it all.
                continue
            priced = req.prompt_logprobs is not None
            want = self._fit_prefill(budget, req.num_computed_tokens, req.num_tokens - req.num_computed_tokens, priced)
            if want == 0:
                return
            num_new = self._fit_chunk(req, want, out)
            if num_new == 0:
                continue
            budget.add_prefill(req.num_computed_tokens, num_new, priced)
            out.chunks.append((req, num_new))
            req.scheduled_step = self._step

    def _prefill_encoded(self, out: SchedulerOutput, budget: StepBudget) -> None:
        """With ``prefill_after_encode``: the requests whose last images this step encodes start
        their prefill in it, in the order they were encoded, while the step has room. Without
        it, a step that encodes the images of every request waiting to prefill carries only
        them and the decodes: on a CPU at peak, one step in four or five left a third of its
        bound unused, and those prompts started a step later."""
        for req, index in out.encodes:
            # A request's images are scheduled in order: its last one to encode here means all are.
            if _next_to_encode(req, index) != req.num_images or req.status is not RequestStatus.ENCODING:
                continue
            start, priced = req.num_computed_tokens, req.prompt_logprobs is not None
            want = budget.fit_prefill(start, req.num_tokens - start, self.min_chunk, priced=priced)
            num_new = self._fit_chunk(req, want, out) if want else 0
            if num_new == 0:
                return
            self._start_prefill(req)
            budget.add_prefill(start, num_new, priced)
            out.chunks.append((req, num_new))
            req.scheduled_step = self._step

    def _schedule_images(self, req: Request, budget: StepBudget, out: SchedulerOutput) -> None:
        """``req``'s next images to encode, in order, while the step has room (those found in
        the image cache are not encoded)."""
        found = req.found_images
        for index in range(_next_image(out, req), req.num_images):
            if found[index]:
                continue
            if not self._add_image(budget, req.images[index]):
                return
            out.encodes.append((req, index))

    def admit_pulls(self) -> list[Pull]:
        """Pulls of migrating requests admitted ahead of the next ``schedule`` (so their copy
        can end before the step is built). A KV pull here leaves one free block per running
        decode, which the step may need to grow it; the rest wait for ``schedule``."""
        out = SchedulerOutput()
        self._admit_incoming(out, reserve=len(self.decoding) if self.kv is not None else 0)
        return out.pulls

    def _admit_incoming(self, out: SchedulerOutput, reserve: int = 0) -> None:
        """Migrating requests go first; a target never pulls what it has no room for.
        ``reserve``: KV blocks a KV pull must leave free, beside what the prompts admitted
        here still need (``_kv_promised``): taken by decodes handed over from elsewhere, the
        blocks the running decodes free stop a prompt mid-prefill for as long as other
        instances keep prefilling (where a redeploy takes P from this instance, its hand-over
        waits on that prompt), and the prompt crawls a token a step until it is preempted."""
        promised = None
        budget, full = None, False  # the next step's decodes, once needed; whether a first token did not fit
        i = 0
        while i < len(self.incoming):
            req = self.incoming[i]
            kind, source, src_block_ids, num_computed = req.pull
            if (kind == "kv" and req.num_output_tokens <= 1 and self.latency_model is not None
                    and not self.can_prefill):
                # A first token handed over to an instance that only decodes: taken only where
                # the next step can carry its decode (``_decode_budget``); else it waits at its
                # source, which then holds its new prompts (``_hold_new``) instead of giving
                # more streams a first token. (An instance that also prefills takes it at once:
                # its steps keep room for it, ``_bound_for_handoffs``, and its own prompts
                # would wait behind it.) The streams handed over mid-answer behind it (a
                # redeploy taking D away from another instance) are taken meanwhile.
                if budget is None:
                    budget = self._decode_budget()
                if full or not budget.add_decode(num_computed + 1):
                    full = True  # the first tokens after it wait too, in their order
                    i += 1
                    continue
            if kind == "image":
                # Another of its prompt's completions is computing it here: its pull waits.
                # (Blocks are noted as computing only while prefix caching is on.)
                if self._computing and (self._waits_for_group(req) if self.replay_cached
                                        else self._waits_for_prefix(req, len(self._cached_prefix(req)))):
                    i += 1
                    continue
                need = self._image_blocks_needed(req)
                if not self.images.can_allocate(need):
                    return
                self._allocate_images(req)
                src = [b for ids in src_block_ids for b in ids]
                dst = [b for ids in req.image_block_ids for b in ids]
            else:
                req.preemptible = self._can_recompute(req)
                slots = num_computed + 1 if req.preemptible else self._full_len(req)
                need = self.kv.num_blocks_for(slots)
                if promised is None:
                    promised = self._kv_promised() + self._older_prompt_need(req)
                if not self.kv.can_allocate(need + reserve + promised):
                    return
                req.kv_block_ids = self.kv.allocate(need)
                # Only the blocks that hold computed tokens are copied: a source that could not
                # recompute reserved blocks for the request's whole length, and this instance
                # may reserve fewer.
                src = list(src_block_ids)[: self.kv.num_blocks_for(num_computed)]
                dst = req.kv_block_ids[: len(src)]
            del self.incoming[i]
            req.status = RequestStatus.PULLING
            self.pulling[req.req_id] = req
            out.pulls.append(Pull(req, kind, source, src, dst))
            if kind == "image":  # its prefill is here: the others of its prompt wait for it
                self._note_computing(req)

    def _admit_new(self, out: SchedulerOutput, budget: StepBudget, long: bool | None = None) -> None:
        """Admit waiting requests in order while there is room: a slot (``max_num_seqs``), the
        image cache for its images, the step's budget for its first image or prompt chunk, and,
        where its prompt is prefilled, KV for that whole prompt beside what the requests
        admitted before it still need for theirs (``_kv_promised``). Admitted on image-cache
        room alone, hundreds of image requests over-commit the pool once their prefills start,
        and preempt each other (an image request preempted is encoded again).
        ``long``: only requests of that kind; the first one of the other kind passed over keeps
        its slot, its image blocks and its prompt's KV blocks (it waits for the step's room,
        not for them, and may have come first)."""
        kv = self.kv
        bs = kv.block_size if kv is not None else 0
        free_for_prompts = None  # free KV blocks less the admitted prompts' needs, once needed
        held_slots = held_kv = held_images = 0  # kept for the request passed over
        i = 0
        while i < len(self.waiting) and len(self.running) + len(self.encoding) + held_slots < self.config.max_num_seqs:
            req = self.waiting[i]
            if long is not None and req.long_prompt is not long:
                if not held_slots:
                    held_slots = 1
                    if kv is not None and self.can_prefill:
                        held_kv = kv.num_blocks_for(req.num_tokens)
                    if req.images and self.images is not None and not req.images_done:
                        held_images = self._image_blocks_needed(req, req.num_encoded_images)
                i += 1
                continue
            cached = self._cached_prefix(req) if self._caching else []
            if self._computing and (self._waits_for_group(req) if self.replay_cached
                                    else self._waits_for_prefix(req, len(cached))):
                i += 1  # the next one may go first: this one waits for a prompt, not for room
                continue
            replayed = self._replayed_blocks(req)
            skipped = _num_images_before(req, (len(cached) + replayed) * bs)
            # Its images from ``skipped`` on found encoded (the image cache), and the first it
            # encodes here (``num_images``: none).
            found = None
            if skipped < req.num_images:
                if self._image_caching:
                    found = self._found_images(req, skipped)
                elif self.replay_cached and not self.can_prefill and req.num_cached_tokens:
                    found = self._replayed_images(req, skipped)
            first = skipped if found is None else next(
                (skipped + j for j, blocks in enumerate(found) if not blocks), req.num_images)
            if self._encoding_images and first < req.num_images and self._waits_for_image(req, first):
                i += 1  # as for a prefix: it waits for that image, not for room
                continue
            if kv is not None and self.can_prefill:
                if free_for_prompts is None:
                    free_for_prompts = kv.num_free_blocks - self._kv_promised()
                # Found blocks nobody holds leave the free count as they are taken.
                prompt_need = kv.num_blocks_for(req.num_tokens) - len(cached) + kv.num_unheld(cached)
                if prompt_need + held_kv > free_for_prompts:
                    return
                free_for_prompts -= prompt_need
            if skipped < req.num_images and not self.images.can_allocate(
                    self._image_blocks_to_take(req, skipped, found) + held_images):
                return
            if first < req.num_images:
                if not self._add_image(budget, req.images[first]):
                    return
                del self.waiting[i]
                self._take_prefix(req, cached, skipped, replayed)
                self._note_computing(req)
                self._allocate_images(req, skipped, found)
                req.num_encoded_images = first
                req.status = RequestStatus.ENCODING
                self.encoding[req.req_id] = req
                out.encodes.append((req, first))
                self._schedule_images(req, budget, out)
            elif not self.can_prefill:
                # Every image found encoded, on an instance that encodes only: on to its prefill.
                self._allocate_images(req, skipped, found)
                req.num_encoded_images = req.num_held_images = req.num_images
                req.mark("encode_done", self.clock())
                self._offer(req, "image")  # out of the waiting queue: the next is at ``i``
            else:
                start = (len(cached) + replayed) * bs
                priced = req.prompt_logprobs is not None
                want = self._fit_prefill(budget, start, req.num_tokens - start, priced)
                if want == 0:
                    return
                del self.waiting[i]
                self._take_prefix(req, cached, skipped, replayed)
                self._note_computing(req)
                if skipped < req.num_images:  # the rest of its images found encoded
                    self._allocate_images(req, skipped, found)
                    req.num_encoded_images = req.num_images
                    req.num_held_images = self._num_held_images(req)
                self._start_running(req)
                self.kv.grow(req.kv_block_ids, start + want)
                budget.add_prefill(start, want, priced)
                out.chunks.append((req, want))
                req.scheduled_step = self._step

    def _waited_longer(self) -> bool:
        """Whether the first waiting request arrived before the first migrating one: it is
        admitted first. Migrating requests go first otherwise (they are a later stage of
        earlier requests), but an instance that prefills and also takes decodes from others
        would never admit a new prompt while their offers keep coming."""
        return bool(self.waiting) and self.waiting[0].arrival_time <= self.incoming[0].arrival_time

    def _older_prompt_need(self, req: Request) -> int:
        """KV blocks a KV pull of ``req`` leaves for the first waiting request's prompt where
        that one arrived first and is prefilled here (``_waited_longer``)."""
        head = self.waiting[0] if self.waiting else None
        if head is None or not self.can_prefill or head.arrival_time > req.arrival_time:
            return 0
        return self.kv.num_blocks_for(head.num_tokens)

    def _kv_promised(self) -> int:
        """KV blocks the admitted requests still need here before their first token: the rest of
        the prompts being prefilled, and the whole (uncached) prompts of those being encoded
        (where they are prefilled here: not once P is handed over)."""
        kv = self.kv
        admitted = [*self.prefilling.values(), *(self.encoding.values() if self.can_prefill else ())]
        return sum(max(0, kv.num_blocks_for(r.num_tokens) - len(r.kv_block_ids)) for r in admitted)

    # -- prefix caching ------------------------------------------------------------------------
    def _cached_prefix(self, req: Request) -> list[int]:
        """The registered blocks of ``req``'s longest cached prefix (not taken), leaving at least
        its last token to compute (that one samples). An image it ends inside is encoded for
        the rest of its tokens. Nothing for a request that asks for its prompt's
        log-probabilities (it computes them all)."""
        bs = self.kv.block_size
        max_blocks = (req.num_tokens - 1) // bs
        if max_blocks < 1 or req.prompt_logprobs is not None:  # it computes every prompt token
            return []
        return self.kv.lookup(block_digests(req, bs, max_blocks))

    def _note_computing(self, req: Request) -> None:
        """``req`` is admitted (or pulled in to be prefilled here): the full blocks of its prompt
        past its cached prefix are being computed here (``_computing``), until ``_register``
        finds them in the pool. (A pulled request takes its cached prefix when its pull ends:
        the blocks of that prefix it was noted for are forgotten then.) In the simulator, the
        completion of a group that computes its prompt is noted by its group."""
        if self.replay_cached:
            if req.group is not None and not self._replays_group_prompt(req):
                self._computing.setdefault(req.group, req)
            return
        if not self._caching or req.digests_stopped:
            return
        bs = self.kv.block_size
        computing = self._computing
        for digest in block_digests(req, bs, req.num_tokens // bs)[req.num_registered_blocks:]:
            computing.setdefault(digest, req)

    def _forget_computing(self, req: Request, num_blocks: int | None = None) -> None:
        """``req`` leaves its prefill (preempted, aborted, handed over): nobody waits for the
        blocks it has not registered any more (``num_blocks``: its first so many only)."""
        computing = self._computing
        for digest in req.block_digests[:num_blocks]:
            if computing.get(digest) is req:
                del computing[digest]
        if num_blocks is None:
            self._forget_group(req)

    def _forget_group(self, req: Request) -> None:
        """``req``'s prefill is over (its first token, or it left): its group (simulated) waits
        for it no more."""
        if req.group is not None and self._computing.get(req.group) is req:
            del self._computing[req.group]

    @staticmethod
    def _replays_group_prompt(req: Request) -> bool:
        """Whether a simulated completion found at least half its prompt cached when traced: it
        waited for another of its group to compute it (``_computing``)."""
        return req.num_cached_tokens is not None and 2 * req.num_cached_tokens >= req.num_prompt_tokens

    def _waits_for_group(self, req: Request) -> bool:
        """Whether ``req`` (simulated) is one of a prompt's completions that found it cached when
        traced while another of them computes it here: it waits for that one's prefill."""
        leader = self._computing.get(req.group) if req.group is not None else None
        return leader is not None and leader is not req and self._replays_group_prompt(req)

    def _waits_for_prefix(self, req: Request, num_cached: int) -> bool:
        """Whether ``req``'s next block past its ``num_cached`` cached ones is one that a request
        admitted here computes now (``_computing``), in a run of at least half the tokens
        ``req`` would compute: then ``req`` waits for that prefill and finds it cached, instead
        of computing the same tokens beside it. The ``n`` completions of one prompt prefill it
        once (the first; the others compute its last partial block), as do equal prompts sent
        at once; a prompt that shares only a short beginning (a system prompt) with one being
        computed does not wait for it. A request that asks for its prompt's log-probabilities
        computes every token anyway, and never waits."""
        if req.prompt_logprobs is not None:
            return False
        digests, bs = req.block_digests, self.kv.block_size
        limit = min(len(digests), (req.num_tokens - 1) // bs)  # as ``_cached_prefix`` looks
        # Worth a wait where the run is at least half of what it would compute.
        enough = -(-(req.num_tokens - num_cached * bs) // (2 * bs))
        if num_cached + enough > limit:
            return False
        computing, prefilling, encoding, pulling = self._computing, self.prefilling, self.encoding, self.pulling
        # The blocks from its next on that requests here compute (one, or several in turn).
        for digest in digests[num_cached:num_cached + enough]:
            leader = computing.get(digest)
            if leader is None:
                return False
            if (prefilling.get(leader.req_id) is not leader and encoding.get(leader.req_id) is not leader
                    and pulling.get(leader.req_id) is not leader):
                # Never met while every way out of a prefill forgets its blocks (``check_integrity``
                # asserts it); kept so that a way missed costs a recomputed prefix, not a prompt
                # waiting for ever.
                del computing[digest]
                return False
        return True

    # -- the image cache -------------------------------------------------------------------------
    def _found_images(self, req: Request, first: int) -> list[list[int]]:
        """For each of ``req``'s images from ``first`` on, the image-cache blocks registered with
        its features (encoded here before: ``_register_image``), or [] where they are not all
        there (an image of unknown content is never found)."""
        images = self.images
        found = []
        for image in req.images[first:]:
            num_blocks = images.num_blocks_for(image.length)
            digests = image_block_digests(image, num_blocks)
            blocks = images.lookup(digests) if digests is not None else []
            found.append(blocks if len(blocks) == num_blocks else [])
        return found

    def _replayed_images(self, req: Request, first: int) -> list[list[int]] | None:
        """The simulator's (``replay_cached``) image cache on an instance that only encodes: the
        images of ``req`` from ``first`` on that lie in the prompt tokens it found cached when
        traced were sent before, and are found (``REPLAYED``: in blocks taken fresh, its
        requests carry no content to look up); the rest are encoded."""
        inside = _num_images_before(req, req.num_cached_tokens)
        if inside <= first:
            return None
        return [REPLAYED if i < inside else [] for i in range(first, req.num_images)]

    def _waits_for_image(self, req: Request, index: int) -> bool:
        """Whether ``req``'s image ``index`` is one that another request admitted here encodes
        now (``_encoding_images``): then ``req`` waits for that encode and finds it in the
        image cache, instead of encoding the same image beside it (the ``n`` completions of a
        prompt on an instance that encodes for others' prefill; requests that ask about one
        image in different words)."""
        content = req.images[index].digest()
        leader = self._encoding_images.get(content) if content is not None else None
        return leader is not None and leader is not req

    def _register_image(self, req: Request, index: int) -> None:
        """``req``'s image ``index`` is encoded: its blocks are findable by its content from now
        on (the image cache), as long as they are not needed for other images."""
        blocks = req.image_block_ids[index]
        if not blocks:  # aborted while the step ran: its blocks are back
            return
        image = req.images[index]
        digests = image_block_digests(image, len(blocks))
        if digests is None:
            return
        for block_id, digest in zip(blocks, digests):
            self.images.register(block_id, digest)
        content = image.digest()
        if self._encoding_images.get(content) is req:
            del self._encoding_images[content]

    def _forget_images(self, req: Request) -> None:
        """``req`` gives its image blocks back: nobody waits for the images it was encoding."""
        encoding = self._encoding_images
        for image in req.images:
            if image.content_hash is not None and encoding.get(image.content_hash) is req:
                del encoding[image.content_hash]

    def _replayed_blocks(self, req: Request) -> int:
        """KV blocks of the traced hit a simulated request replays here (``replay_cached``)."""
        if not (self.replay_cached and req.num_cached_tokens and self.kv is not None and self.can_prefill):
            return 0
        return min(req.num_cached_tokens, req.num_tokens - 1) // self.kv.block_size

    def _take_prefix(self, req: Request, cached: list[int], skipped_images: int = 0, replayed: int = 0) -> None:
        """``req`` holds ``cached`` (``_cached_prefix``) and starts after it; its first
        ``skipped_images`` images lie inside and need no encoding. ``replayed``: blocks of a
        traced hit to take fresh instead (``replay_cached``)."""
        if replayed:
            req.kv_block_ids = self.kv.allocate(replayed)
            req.num_computed_tokens = replayed * self.kv.block_size
            req.num_encoded_images = max(req.num_encoded_images, skipped_images)
            self.prefix_hits += req.num_computed_tokens
            self.images_cached += skipped_images
            return
        if not self._caching:
            return
        self.prefix_queries += req.num_tokens
        if req.num_cached_tokens is None:  # of its prompt (one run again brings output tokens too)
            req.num_cached_tokens = min(len(cached) * self.kv.block_size, req.num_prompt_tokens)
        if not cached:
            return
        self.kv.acquire(cached)
        req.kv_block_ids = list(cached)
        req.num_computed_tokens = req.num_registered_blocks = len(cached)
        req.num_computed_tokens *= self.kv.block_size
        req.num_encoded_images = max(req.num_encoded_images, skipped_images)
        self.prefix_hits += req.num_computed_tokens
        self.images_cached += skipped_images

    def _register(self, req: Request) -> None:
        """Register ``req``'s full blocks computed since the last time (``_caching`` holds)."""
        bs = self.kv.block_size
        full = min(req.num_computed_tokens // bs, len(req.kv_block_ids))
        if full <= req.num_registered_blocks:
            return
        digests = block_digests(req, bs, full)
        kv, block_ids = self.kv, req.kv_block_ids
        computing = self._computing
        for j in range(req.num_registered_blocks, len(digests)):
            kv.register(block_ids[j], digests[j])
            if computing and computing.get(digests[j]) is req:
                del computing[digests[j]]
        req.num_registered_blocks = full

    def finish_pull(self, req: Request) -> None:
        """The copy into req's blocks is done: it runs its next stage here."""
        del self.pulling[req.req_id]
        kind, _, _, num_computed = req.pull
        req.pull = None
        if req.status is RequestStatus.FINISHED:  # aborted while copying
            if self._computing:
                self._forget_computing(req)
            self._free_blocks(req)
            return
        if kind == "image":
            req.num_encoded_images = req.num_images
            req.num_held_images = req.num_images
            req.preemptible = self._can_recompute(req)
            req.mark("image_pulled")
            replayed = self._replayed_blocks(req)
            if self._caching or (replayed and self.kv.can_allocate(replayed)):
                self._take_prefix(req, self._cached_prefix(req) if self._caching else [], 0, replayed)
                self._free_read_images(req)
            if self._computing:  # what it found cached it does not compute
                self._forget_computing(req, req.num_registered_blocks)
        else:
            req.num_computed_tokens = num_computed
            req.mark("kv_pulled")
        self._start_running(req)
        # Pulled for a stage that is being handed over meanwhile: on it goes.
        if kind == "image" and not self.can_prefill:
            self._offer(req, "image")
        elif kind == "kv" and not self.can_decode:
            self._offer(req, "kv")

    # -- KV pressure ---------------------------------------------------------------------
    def _can_recompute(self, req: Request) -> bool:
        """Whether a preempted ``req`` could start again here: its images encoded again needs
        an encoder and their pixels (a request pulled for a later stage carries their layouts
        only)."""
        return self.can_prefill and (not req.images or ("E" in self.role and req.has_pixels))

    def _full_len(self, req: Request) -> int:
        return min(self.max_model_len, req.max_num_tokens)

    def _fit_chunk(self, req: Request, num_new: int, out: SchedulerOutput) -> int:
        """Grow req's KV blocks for up to num_new tokens; shrink the chunk to what fits, and
        preempt later requests only when not a single token fits."""
        bs = self.kv.block_size
        while True:
            room = (len(req.kv_block_ids) + self.kv.num_free_blocks) * bs - req.num_computed_tokens
            if room > 0:
                num_new = min(num_new, room)
                self.kv.grow(req.kv_block_ids, req.num_computed_tokens + num_new)
                return num_new
            if not self._preempt_victim(req, out):
                return 0

    def _reserve_kv(self, req: Request, num_slots: int, out: SchedulerOutput) -> bool:
        while not self.kv.grow(req.kv_block_ids, num_slots):
            if self._preempt_victim(req, out):
                continue
            if req.preemptible and req.is_decode:
                self._preempt(req, out)
            return False
        return True

    def _preempt_victim(self, req: Request, out: SchedulerOutput) -> bool:
        step = self._step
        for victim in reversed(self.running.values()):
            if victim is not req and victim.preemptible and victim.scheduled_step != step:
                self._preempt(victim, out)
                return True
        return False

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free ``req``'s blocks; it starts again from its prompt and the tokens it generated,
        here, or, when this instance no longer runs its first stage (its role changed since it
        was admitted: a redeploy), whole on an instance that does."""
        self._remove(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req)
        if self._runs_first_stage(req):
            req.num_computed_tokens = req.num_encoded_images = 0
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
        else:
            self._move_whole(req)

    # -- results ----------------------------------------------------------------------------
    def update_after_encode(self, out: SchedulerOutput, exec_time: float = 0.0, language_time: float = 0.0) -> None:
        """``exec_time``: seconds of the step's vision work; ``language_time``: of its language
        work, which ran after it where a request's prefill started in the step that encoded
        its images (``prefill_after_encode``: its encoding ended that long before now)."""
        now = self.clock()
        for req, index in out.encodes:
            req.num_encoded_images = _next_to_encode(req, index)
            if self._image_caching:
                self._register_image(req, index)
        for req in {id(r): r for r, _ in out.encodes}.values():
            req.timeline["encode_exec"] += exec_time
            if req.images_done and req.status is _RUNNING:  # its prefill started in this step
                req.mark("encode_done", now - language_time)
            elif req.images_done and req.status is RequestStatus.ENCODING:
                req.mark("encode_done", now)
                if self.can_prefill:
                    self._start_prefill(req)
                    continue
                req.num_held_images = self._num_held_images(req)
                if req.num_held_images < req.num_images:
                    # Its prefill stage was handed over meanwhile, and images inside its cached
                    # prefix have no features to hand on: it moves whole, as if not started.
                    self._remove(req)
                    self._move_whole(req)
                else:
                    self._offer(req, "image")

    def update_after_language(self, out: SchedulerOutput, sampled: list[int], exec_time: float = 0.0
                              ) -> LanguageResult:
        """Advance every chunk; append the sampled token of each request that caught up.

        ``sampled`` holds one token per chunk that completes its request's tokens, in chunk
        order (the runner samples exactly those rows)."""
        # A gap past the bound (the TBT less the headroom a token's delivery takes) counts
        # against the stream's p90 (``_streams_have_slack``).
        now, tbt = self.clock(), self.latency_bound
        result = LanguageResult()
        req_ids, token_ids, sample_index = result.req_ids, result.token_ids, result.sample_index
        num_decodes = out.num_decodes
        max_model_len = self.max_model_len
        # The decodes first, column by column: each samples, each is past its first token.
        # (This loop runs for every decode of every step: ``Request.append_token`` and
        # ``_stop_reason`` are written out in it.)
        for index, req in enumerate([req for req, _ in out.chunks[:num_decodes]]):
            if req.status is not _RUNNING:
                continue  # aborted while the batch ran
            req.timeline["decode_exec"] += exec_time
            req.num_computed_tokens += 1
            token_id = sampled[index]
            req.output_token_ids.append(token_id)
            num_tokens = req.num_tokens = req.num_tokens + 1
            last = req.last_token_time
            if last is not None and now - last > tbt:
                req.num_long_gaps += 1
                self._spend(req)
            req.last_token_time = now
            req_ids.append(req.req_id)
            token_ids.append(token_id)
            sample_index.append(index)
            if token_id in req.stop_ids:
                reason = "stop"
            elif (num_tokens - req.num_prompt_tokens >= req.sampling_params.max_tokens
                  or num_tokens >= max_model_len):
                reason = "length"
            else:
                continue
            self._remove(req)
            self._finish(req, reason)
            result.finished.append(req)
        index = num_decodes - 1
        decoding, prefilling = self.decoding, self.prefilling
        caching = self._caching
        for req, num_new in out.chunks[num_decodes:]:
            computed = req.num_computed_tokens + num_new
            samples = computed == req.num_tokens
            if samples:
                index += 1
            if req.status is not _RUNNING:
                continue  # aborted while the batch ran
            timeline = req.timeline
            if num_new == 1 and req.num_tokens > req.num_prompt_tokens:
                timeline["decode_exec"] += exec_time
            else:
                timeline["prefill_exec"] += exec_time
            req.num_computed_tokens = computed
            if req.num_held_images:
                self._free_read_images(req)
            if caching:
                self._register(req)
            if not samples:
                continue
            token_id = sampled[index]
            req.append_token(token_id)
            if req.last_token_time is not None and now - req.last_token_time > tbt:
                req.num_long_gaps += 1  # recomputed after a preemption
                self._spend(req)
            req.last_token_time = now
            if "first_token" not in timeline:
                timeline["first_token"] = now
            req_ids.append(req.req_id)
            token_ids.append(token_id)
            sample_index.append(index)
            reason = self._stop_reason(req, token_id)
            if reason is None:
                if not self.can_decode:
                    self._offer(req, "kv")
                elif req.req_id in prefilling:
                    del prefilling[req.req_id]
                    decoding[req.req_id] = req
                    if self._computing:  # its blocks are registered; in the simulator, its group
                        self._forget_group(req)
                continue
            self._remove(req)
            self._finish(req, reason)
            result.finished.append(req)
        return result

    def _stop_reason(self, req: Request, token_id: int) -> str | None:
        """Why ``req`` ends with its new ``token_id`` ("stop", "length"), or None: it goes on.
        (The decode loop of ``update_after_language`` has the same test written out.)"""
        if token_id in req.stop_ids:
            return "stop"
        if (req.num_tokens - req.num_prompt_tokens >= req.sampling_params.max_tokens
                or req.num_tokens >= self.max_model_len):
            return "length"
        return None

    def _free_read_images(self, req: Request) -> None:
        for i in req.images_fully_read():
            self.images.free(req.image_block_ids[i])
            req.image_block_ids[i] = []
            req.num_held_images -= 1

    def _offer(self, req: Request, kind: str) -> None:
        self._leave_queue(req)
        req.status = RequestStatus.OFFERED
        req.mark(f"{kind}_offered")
        self.offered[req.req_id] = req
        if kind == "kv" and req.num_output_tokens <= 1:
            self._first_tokens_offered[req.req_id] = self.clock()
        self.new_offers.append((req, kind))

    # -- bookkeeping -------------------------------------------------------------------------
    def _start_prefill(self, req: Request) -> None:
        """Its images encoded here: from encoding to its prefill."""
        del self.encoding[req.req_id]
        req.num_held_images = self._num_held_images(req)
        self._start_running(req)

    @staticmethod
    def _num_held_images(req: Request) -> int:
        # Images inside a cached prefix were never encoded here and hold no blocks.
        return sum(1 for ids in req.image_block_ids if ids)

    def _start_running(self, req: Request) -> None:
        req.status = _RUNNING
        self.running[req.req_id] = req
        if req.is_decode:
            self.decoding[req.req_id] = req
            if req.num_long_gaps:  # migrated in with gaps it had elsewhere
                self._spend(req)
        else:
            self.prefilling[req.req_id] = req

    def _allocate_images(self, req: Request, first: int = 0, found: list[list[int]] | None = None) -> None:
        """Blocks for ``req``'s images from ``first`` on: those ``found`` in the image cache
        (``_found_images``) held as they are, fresh ones for the rest, noted as being encoded
        here where they were looked for (``_waits_for_image``; not for an image pulled in)."""
        images = self.images
        if found is not None:  # held first, so that the fresh blocks taken next cannot evict them
            for i, blocks in enumerate(found, first):
                if blocks is REPLAYED:
                    blocks = images.allocate(images.num_blocks_for(req.image_tokens(i)))
                elif blocks:
                    images.acquire(blocks)
                    blocks = list(blocks)
                if blocks:
                    req.image_block_ids[i] = blocks
                req.found_images[i] = bool(blocks)
            self.images_cached += sum(1 for blocks in found if blocks)
        for i in range(first, req.num_images):
            if found is not None and found[i - first]:
                continue
            req.found_images[i] = False
            req.image_block_ids[i] = images.allocate(images.num_blocks_for(req.image_tokens(i)))
            if found is not None and (content := req.images[i].digest()) is not None:
                self._encoding_images.setdefault(content, req)

    def _image_blocks_needed(self, req: Request, first: int = 0) -> int:
        return sum(self.images.num_blocks_for(req.image_tokens(i)) for i in range(first, req.num_images))

    def _image_blocks_to_take(self, req: Request, first: int, found: list[list[int]] | None) -> int:
        """Free image blocks ``_allocate_images`` takes: fresh ones for the images not ``found``,
        and the found blocks nobody holds (they leave the free count as they are held)."""
        if found is None:
            return self._image_blocks_needed(req, first)
        images = self.images
        return sum(images.num_unheld(blocks) if blocks and blocks is not REPLAYED
                   else images.num_blocks_for(req.image_tokens(i)) for i, blocks in enumerate(found, first))

    def _leave_queue(self, req: Request) -> None:
        """Take req out of the queue of its status (it keeps its blocks)."""
        status = req.status
        if status is _RUNNING:
            del self.running[req.req_id]
            if self.decoding.pop(req.req_id, None) is None:
                del self.prefilling[req.req_id]
                if self._computing:
                    self._forget_computing(req)
            if self._spent:
                self._spent.pop(req.req_id, None)
            self._dropped.append(req)
        elif status is RequestStatus.ENCODING:
            del self.encoding[req.req_id]
            if self._computing:
                self._forget_computing(req)
        elif status is RequestStatus.WAITING:
            (self.incoming if req.pull is not None else self.waiting).remove(req)
        elif status is RequestStatus.OFFERED:
            del self.offered[req.req_id]
            self._first_tokens_offered.pop(req.req_id, None)

    def _remove(self, req: Request) -> None:
        """Take req out of its queue and give back every block it holds."""
        self._leave_queue(req)
        self._free_blocks(req)

    def _free_blocks(self, req: Request) -> None:
        if req.kv_block_ids:
            if self._caching:
                self._register(req)  # what it computed stays findable (a preempted request's own)
            self.kv.free(req.kv_block_ids)
            req.kv_block_ids = []
            req.num_registered_blocks = 0
        for i, block_ids in enumerate(req.image_block_ids):
            if block_ids:
                self.images.free(block_ids)
                req.image_block_ids[i] = []
        req.num_held_images = 0
        if self._encoding_images:
            self._forget_images(req)

    def _finish(self, req: Request, reason: str) -> None:
        if reason == "stop" or reason == "length":
            self._count_length(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.req_id, None)

    def check_integrity(self) -> None:
        """Every block is free or held by exactly one request; queues match statuses."""
        aborted_pulls = [r for r in self.pulling.values() if r.status is RequestStatus.FINISHED]
        holders = list(self.requests.values()) + aborted_pulls
        if self.kv is not None:
            self.kv.check_integrity([r.kv_block_ids for r in holders])
        if self.images is not None:
            self.images.check_integrity([b for r in holders for b in r.image_block_ids])
        queues = {
            RequestStatus.WAITING: list(self.waiting) + list(self.incoming),
            RequestStatus.ENCODING: list(self.encoding.values()),
            RequestStatus.RUNNING: list(self.running.values()),
            RequestStatus.PULLING: [r for r in self.pulling.values() if r.status is not RequestStatus.FINISHED],
            RequestStatus.OFFERED: list(self.offered.values()),
        }
        queued = [r.req_id for q in queues.values() for r in q]
        if sorted(queued) != sorted(self.requests):
            raise AssertionError("scheduler queues and the request table disagree")
        if sorted(self.running) != sorted([*self.decoding, *self.prefilling]):
            raise AssertionError("running is not exactly decoding + prefilling")
        if any(req_id not in self.running for req_id in self._spent):
            raise AssertionError("a stream that left the running requests still guards the steps")
        for r in self._computing.values():
            if (self.prefilling.get(r.req_id) is not r and self.encoding.get(r.req_id) is not r
                    and self.pulling.get(r.req_id) is not r):
                raise AssertionError(f"{r} left its prefill but new prompts may still wait for it")
        for r in self._encoding_images.values():
            if self.encoding.get(r.req_id) is not r:
                raise AssertionError(f"{r} is not encoding but new requests may still wait for its image")
        for r in self.decoding.values():
            if not r.is_decode:
                raise AssertionError(f"{r} sits in the decoding queue")
        for status, queue in queues.items():
            for r in queue:
                if r.status is not status:
                    raise AssertionError(f"{r} sits in the {status.value} queue")
                if status is RequestStatus.WAITING and (r.kv_block_ids or any(r.image_block_ids)):
                    raise AssertionError(f"waiting {r} holds blocks")
                held = sum(1 for ids in r.image_block_ids if ids)
                if status is RequestStatus.RUNNING and held != r.num_held_images:
                    raise AssertionError(f"{r} holds {held} image block lists, counts {r.num_held_images}")


def gaps_past_p90(num_gaps: int) -> int:
    """How many of ``num_gaps`` gaps between tokens may pass a bound with their 90th percentile
    (linear interpolation, as the bench and the planner's simulator compute it) still within
    it: those above both values it interpolates between."""
    if num_gaps < 1:
        return 0
    return num_gaps - 1 - (9 * (num_gaps - 1) + 9) // 10  # ceil(0.9 * (num_gaps - 1)), exactly


def _next_image(out: SchedulerOutput, req: Request) -> int:
    """The first of ``req``'s images past those encoded and those already in this step's encodes
    (only the admission path adds some before ``_schedule_images`` runs for it)."""
    if not out.encodes or out.encodes[-1][0] is not req:
        return req.num_encoded_images
    return out.encodes[-1][1] + 1


def _next_to_encode(req: Request, index: int) -> int:
    """The first of ``req``'s images after ``index`` not found in the image cache (``num_images``:
    none)."""
    found = req.found_images
    index += 1
    while index < len(found) and found[index]:
        index += 1
    return index


def _num_images_before(req: Request, num_tokens: int) -> int:
    """How many of ``req``'s first images lie wholly in its first ``num_tokens`` tokens."""
    n = 0
    for image in req.images:
        if image.offset + image.length > num_tokens:
            break
        n += 1
    return n
