"""An OpenAI-compatible endpoint over the rollout engine, on loopback: any agent program written against the
`openai` client generates the trajectories, and every token it was served is recorded for training.

    server = CompletionServer(actor.generate, tokenizer, settings, model_name="policy")
    key = server.open_session()                 # one per agent run: its API key names its trajectory
    # the agent: openai.OpenAI(base_url=server.base_url, api_key=key).chat.completions.create(messages=..., tools=...)
    s = server.close_session(key)              # its Session: the first prompt's ids, then every token after it
    server.close()

`POST /v1/chat/completions` takes `messages`, `tools` (rendered by the chat template, as rollouts with tools
are), `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `top_k`, `stop`-less, `n` = 1; it answers
with a chat.completion whose message holds the text and, where the model wrote hermes `<tool_call>`s and the
request gave tools, `tool_calls` (finish_reason "tool_calls"). `GET /v1/models` names the one model.

Exact tokens: when a request's messages extend the session's conversation (the earlier messages, the answers
as served, then new tool / user messages), its prompt is the session's tokens as they were sampled plus the
chat template's rendering of the new messages (rollout.multiturn.continuation_ids): nothing the model generated
is ever re-tokenized, so the session is one sequence, its generated tokens with their log-probs (mask 1) and the
messages between them (mask 0). A request that does not extend it (an agent that rewrote its history) starts a
new chain, and the session keeps the newest (`broken` counts the others).

Batching: requests from many agent runs are sampled together: the dispatcher thread waits until every open
session still running has a request queued, or `batch_wait_s` after the first, then samples them in one call
per distinct set of sampling settings. A session's responses share one budget, settings.max_response_length
tokens after its first prompt (as a rollout's turns do): past it, an empty answer with finish_reason "length".
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from posttrain.data.dataset import encode_prompt
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.multiturn import MultiTurnSettings, continuation_ids
from posttrain.text.lines import one_line
from posttrain.tools.hermes import CLOSE, OPEN, parse_tool_calls

MAX_BODY = 16 * 2**20


@dataclass
class Session:
    """One agent run's tokens: its (newest) chain's first prompt, and every token after it."""

    prompt_ids: list = field(default_factory=list)
    seq: list = field(default_factory=list)  # response tokens: generated and between
    gen: list = field(default_factory=list)  # 1: generated
    logp: list = field(default_factory=list)
    messages: list = field(default_factory=list)  # the conversation as served, its answers included
    completions: int = 0
    broken: int = 0  # requests that did not extend the conversation: a new chain began
    truncated: bool = False  # its last answer ran into a length limit
    last_token: int | None = None
    closed: bool = False


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


class CompletionServer:
    """The endpoint (see the module). `generate(prompts, params) -> RolloutOutput` is the rollout engine's verb;
    `settings` the multi-turn settings (budget, EOS ids, the chat template's arguments)."""

    def __init__(self, generate, tokenizer, settings: MultiTurnSettings, model_name: str = "policy",
                 batch_wait_s: float = 0.05, defaults: SamplingParams | None = None):
        self.generate, self.tokenizer, self.settings, self.model_name = generate, tokenizer, settings, model_name
        self.batch_wait_s = batch_wait_s
        self.defaults = defaults or SamplingParams(max_new_tokens=settings.max_response_length)
        self.sessions: dict[str, Session] = {}
        self.running: set[str] = set()  # sessions whose agent still runs (the dispatcher waits for them)
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._http = _Listener(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        self._threads = [threading.Thread(target=self._http.serve_forever, name="posttrain-openai", daemon=True),
                         threading.Thread(target=self._dispatch, name="posttrain-openai-batch", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}/v1"

    def open_session(self) -> str:
        key = "pt-" + secrets.token_hex(12)
        with self._lock:
            self.sessions[key] = Session()
        return key

    def agent_started(self, key: str) -> None:
        """The agent run of `key` is running: the dispatcher waits for its requests."""
        with self._lock:
            self.running.add(key)

    def agent_done(self, key: str) -> None:
        """The agent run is over: the dispatcher stops waiting for it."""
        with self._lock:
            self.running.discard(key)

    def close_session(self, key: str) -> Session:
        with self._lock:
            self.running.discard(key)
            s = self.sessions.pop(key)
            s.closed = True
        return s

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop listening and end both threads (the dispatcher first finishes a batch it is sampling)."""
        self._http.shutdown()
        self._http.server_close()
        self._queue.put(None)
        for t in self._threads:
            t.join(timeout_s)

    # -- a request, in its HTTP thread ------------------------------------------------------------------------
    def complete(self, key: str, body: dict) -> dict:
        with self._lock:
            s = self.sessions.get(key)
        if s is None or s.closed:
            raise RequestError(401, "unknown or finished API key: each agent run gets its own key from posttrain",
                               "authentication_error")
        messages, tools = _messages(body), body.get("tools") or None
        if body.get("n", 1) not in (1, None):
            raise RequestError(400, "n must be 1: each agent run is one trajectory (posttrain samples rollout.n "
                                    "runs per prompt)")
        template = {**self.settings.template_kwargs, **({"tools": tools} if tools else {})}
        with self._lock:
            extends = bool(s.messages) and _same(messages[:len(s.messages)], s.messages) and len(messages) > len(s.messages)
        if extends:
            between = continuation_ids(self.tokenizer, s.messages, messages[len(s.messages):], template, s.last_token)
            prompt = s.prompt_ids + s.seq + between
        else:
            between, prompt = [], encode_prompt(self.tokenizer, messages, template)
        room = self.settings.max_response_length - (len(s.seq) + len(between) if extends else 0)
        wanted = body.get("max_completion_tokens") or body.get("max_tokens") or room
        params = self._params(body, max(0, min(int(wanted), room)))
        tokens, logps, ended = self._sample(prompt, params) if params.max_new_tokens > 0 else ([], [], False)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        reply = _message(text, tools is not None)
        with self._lock:
            if not extends:
                if s.messages:
                    s.broken += 1
                s.prompt_ids, s.seq, s.gen, s.logp = list(prompt), [], [], []
            s.seq += between + tokens
            s.gen += [0] * len(between) + [1] * len(tokens)
            s.logp += [0.0] * len(between) + logps
            s.messages = list(messages) + [{**reply, "content": reply["content"] or ""}]  # as templates read it
            s.completions += 1
            s.truncated = not ended
            s.last_token = tokens[-1] if tokens else s.last_token
        finish = ("tool_calls" if reply.get("tool_calls") else "stop") if ended else "length"
        return {"id": "chatcmpl-" + secrets.token_hex(8), "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                          "total_tokens": len(prompt) + len(tokens)}}

    def _params(self, body: dict, max_new_tokens: int) -> SamplingParams:
        d = self.defaults
        temperature = float(body["temperature"]) if body.get("temperature") is not None else d.temperature
        return SamplingParams(max_new_tokens=max_new_tokens, n=1, temperature=temperature,
                              top_p=float(body.get("top_p") if body.get("top_p") is not None else d.top_p),
                              top_k=int(body.get("top_k") if body.get("top_k") is not None else d.top_k),
                              do_sample=temperature > 0 and d.do_sample, logprobs=True)

    def _sample(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float], bool]:
        done: Future = Future()
        self._queue.put((prompt, params, done))
        return done.result()

    # -- the dispatcher thread --------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            pending, deadline = [first], time.monotonic() + self.batch_wait_s
            while True:
                with self._lock:
                    expected = len(self.running)
                if len(pending) >= expected:
                    break
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                pending.append(item)
            groups: dict[SamplingParams, list] = {}
            for item in pending:
                groups.setdefault(item[1], []).append(item)
            for params, items in groups.items():
                self._generate(params, items)

    def _generate(self, params: SamplingParams, items: list) -> None:
        try:
            out = self.generate([prompt for prompt, _, _ in items], params)
        except BaseException as e:  # noqa: BLE001  every waiting request gets the error
            for _, _, done in items:
                done.set_exception(RequestError(500, f"generation failed: {one_line(e)}", "server_error"))
            return
        eos = set(self.settings.eos_token_ids)
        for j, (_, _, done) in enumerate(items):
            keep = out.response_mask[j].bool()
            tokens = out.response_ids[j][keep].tolist()
            logps = out.log_probs[j][keep].tolist() if out.log_probs is not None else [0.0] * len(tokens)
            done.set_result((tokens, logps, bool(tokens) and tokens[-1] in eos))


class _Listener(ThreadingHTTPServer):
    """Every agent run connects at once (agent_workers of them): the socketserver default backlog of 5 would drop
    their connections' SYNs, which the client retries after 1, 3, 7 s, past openai's 5 s connect timeout when the
    trainer keeps this process busy; an agent with no retries then fails its sample."""

    request_queue_size = 1024


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                  for m in messages):
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects")
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None and k in ("role", "content", "tool_calls", "tool_call_id",
                                                                    "name")}
        if isinstance(m.get("content"), list):  # content parts: their text
            m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
        m.setdefault("content", "")
        out.append(m)
    return out


def _normal(m: dict) -> tuple:
    calls = tuple((c.get("function", {}).get("name"), _args(c.get("function", {}).get("arguments")))
                  for c in m.get("tool_calls") or [])
    return m.get("role"), m.get("content") or "", calls


def _args(arguments):
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), sort_keys=True)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(_normal(x) == _normal(y) for x, y in zip(a, b))


def _message(text: str, with_tools: bool) -> dict:
    """The assistant message for a sampled text: hermes tool calls as OpenAI tool_calls (when the request gave
    tools), the text around them as content."""
    calls, _ = parse_tool_calls(text) if with_tools else ([], [])
    if not calls:
        return {"role": "assistant", "content": text}
    content = text
    while OPEN in content and CLOSE in content:
        start, end = content.index(OPEN), content.index(CLOSE) + len(CLOSE)
        content = content[:start] + content[end:]
    return {"role": "assistant", "content": content.strip() or None,
            "tool_calls": [{"id": "call_" + secrets.token_hex(6), "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]}


def _handler(server: CompletionServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # no access log on the console
            pass

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")  # a request per connection: no thread waits on an idle one
            self.end_headers()
            self.close_connection = True
            self.wfile.write(data)

        def _error(self, e: RequestError) -> None:
            self._send(e.status, {"error": {"message": str(e), "type": e.kind, "code": None}})

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                                             "owned_by": "posttrain"}]})
            else:
                self._error(RequestError(404, f"no route {self.path}; posttrain serves /v1/chat/completions"))

        def do_POST(self):
            try:
                if self.path.rstrip("/") != "/v1/chat/completions":
                    raise RequestError(404, f"no route {self.path}; posttrain serves /v1/chat/completions")
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    raise RequestError(400, "send the body with a Content-Length")
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_BODY:
                    raise RequestError(400, "a JSON body of at most 16 MiB is expected")
                try:
                    body = json.loads(self.rfile.read(length))
                except ValueError:
                    raise RequestError(400, "the body is not JSON") from None
                if not isinstance(body, dict):
                    raise RequestError(400, "the body must be a JSON object")
                if body.get("stream"):
                    raise RequestError(400, "stream=true is not supported: ask for whole completions")
                key = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
                self._send(200, server.complete(key, body))
            except RequestError as e:
                self._error(e)
            except Exception as e:  # noqa: BLE001  the agent gets an answer, the run goes on
                self._error(RequestError(500, one_line(e), "server_error"))

    return Handler
