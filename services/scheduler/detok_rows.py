"""One step's text work for the detokenizers, built a row per request into one columnar message."""

from __future__ import annotations

from rill.services.scheduler.request import Request
from rill.shared.kinds import FinishReason
from rill.shared.schema import DetokBatch, TokenLogprobs


class DetokRows:
    """Columnar builder for one step's DetokBatch."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.reply_to: list[str] = []
        self.offsets: list[int] = []
        self.new: list[list[int]] = []
        self.context: list[list[int]] = []
        self.reasons: list[FinishReason | None] = []
        self.prompt_tokens: list[int] = []
        self.cached_tokens: list[int] = []
        self.stop: list[list[str]] = []
        self.skip_special: list[bool] = []
        self.include_stop: list[bool] = []
        self.logprobs: list[list[TokenLogprobs]] = []
        self.prompt_logprobs: list[list[TokenLogprobs]] = []
        self.prompt_ids: list[list[int] | None] = []
        self.prediction: list[list[int]] = []

    def __bool__(self) -> bool:
        return bool(self.ids)

    def add(self, req: Request, offset: int, new: list[int], reason: FinishReason | None,
            logprobs: list[TokenLogprobs], prompt_logprobs: list[TokenLogprobs]) -> None:
        p = req.params
        ctx = req.detok_context
        self.ids.append(req.request_id)
        self.reply_to.append(req.reply_to)
        self.offsets.append(offset)
        self.new.append(new)
        self.context.append(req.output_token_ids[offset - ctx if offset > ctx else 0:offset])
        self.reasons.append(reason)
        self.prompt_tokens.append(len(req.prompt_token_ids))
        self.cached_tokens.append(req.num_cached_tokens if offset == 0 else 0)
        self.stop.append(p.stop)
        self.skip_special.append(p.skip_special_tokens)
        self.include_stop.append(p.include_stop_str_in_output)
        self.logprobs.append(logprobs)
        self.prompt_logprobs.append(prompt_logprobs)
        self.prompt_ids.append((req.prompt_token_ids if offset == 0 else []) if p.return_token_ids else None)
        accepted = req.num_prediction_accepted
        self.prediction.append([accepted, req.num_prediction_drafts - accepted] if req.prediction else [])

    def batch(self, engine_id: int, step_id: int) -> DetokBatch:
        return DetokBatch(engine_id=engine_id, step_id=step_id, request_ids=self.ids,
                          reply_to=self.reply_to, offsets=self.offsets, new_token_ids=self.new,
                          context_ids=self.context, finish_reasons=self.reasons,
                          prompt_tokens=self.prompt_tokens, stop=self.stop,
                          skip_special_tokens=self.skip_special, include_stop_str=self.include_stop,
                          # Columns nobody asked for stay empty, so they cost nothing on the wire.
                          logprobs=self.logprobs if any(self.logprobs) else [],
                          prompt_logprobs=self.prompt_logprobs if any(self.prompt_logprobs) else [],
                          cached_tokens=self.cached_tokens if any(self.cached_tokens) else [],
                          prompt_ids=self.prompt_ids if any(i is not None for i in self.prompt_ids) else [],
                          prediction_tokens=self.prediction if any(self.prediction) else [])
