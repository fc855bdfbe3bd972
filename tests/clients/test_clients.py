"""Real coding-agent clients against `slipstream serve`: the server's
acceptance tests.

Each client runs non-interactively in a throwaway project with a throwaway
home (telemetry and update checks off, no network but the server) against
the demo model, whose replies come from a script (`--test-script`):

1. the client's main turn (its prompt holds the task's tag and a tool
   block) gets a tool call in Qwen3.6's XML form naming the client's own
   shell tool, which prints note.txt, a file holding a fresh marker;
2. the prompt holding that marker (only the tool's result can bring it)
   gets the final answer;
3. anything else (titles, summaries) gets a plain filler.

So the final answer appears in the client's output only when the client
was served its first turn, ran the tool, sent its result back and the
result reached the model's prompt. aider does not call tools: it edits
files, so its "model" answers with a SEARCH/REPLACE block for note.txt
(matched by the marker, which only the file's contents bring) and the test
checks the edit landed.

Every request is recorded (`--log-requests`) under target/clients/logs/;
with UPDATE_FIXTURES=1 the request carrying the tool result (else the
first one) becomes crates/server/tests/fixtures/clients/<client>.json.
"""

import json
import os
import secrets
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "common"))
from slipserve import ROOT, Server  # noqa: E402

LOGS = os.path.join(ROOT, "target", "clients", "logs")
FIXTURES = os.path.join(ROOT, "crates", "server", "tests", "fixtures", "clients")
# A fixture's largest size; longer strings are cut (the shape is kept).
FIXTURE_MAX_BYTES = 150_000
# Seconds a client may take for its whole run.
CLIENT_TIMEOUT = 240


def client_bin(name):
    d = os.environ.get("CLIENTS_BIN")
    if not d:
        pytest.skip("CLIENTS_BIN is not set (run tests/clients/run.sh)")
    return os.path.join(d, name)


def tool_call(name, **params):
    """A tool call in Qwen3.6's (Qwen3-Coder's) XML form."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


class Trip:
    """One client's round trip: a throwaway home and project, a note with a
    fresh marker, a scripted server, and the client's run."""

    def __init__(self, tmp_path, name):
        self.name = name
        tag = secrets.token_hex(6)
        self.task = f"task-{tag}"
        self.marker = f"tool-result-{tag}"
        self.answer = f"final-answer-{tag}"
        self.home = tmp_path / "home"
        self.work = tmp_path / "project"
        self.home.mkdir()
        self.work.mkdir()
        (self.work / "note.txt").write_text(self.marker + "\n")
        os.makedirs(LOGS, exist_ok=True)
        self.log = os.path.join(LOGS, f"{name}.jsonl")
        if os.path.exists(self.log):
            os.unlink(self.log)
        self.server = None

    def prompt(self):
        return f"Run `cat note.txt` and tell me what it says. ({self.task})"

    def serve(self, first_reply, extra_args=(), main_turn=None):
        """`first_reply` answers the main turn, found by the task's tag and
        `main_turn` (default: the tool block the server renders when a
        request carries tools)."""
        main_turn = main_turn or ["<tools>"]
        # Each rule answers once: a follow-up without the tool's result
        # gets the filler, and the test fails at once instead of looping.
        script = [
            {"when": [self.task] + main_turn, "reply": first_reply, "times": 1},
            {"when": [self.marker], "reply": f"The note has been read. {self.answer}", "times": 1},
            "Nothing to add.",
        ]
        self.server = Server(
            ["--model-name", "demo", *extra_args], script=script, log_requests=self.log
        )
        return self.server

    def env(self, **extra):
        """A clean environment: no inherited keys or settings; the home,
        its XDG directories and the temporary directory are the trip's."""
        home = str(self.home)
        tmp = self.home / "tmp"
        tmp.mkdir(exist_ok=True)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": home,
            "USER": os.environ.get("USER", "tester"),
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "NO_COLOR": "1",
            "TMPDIR": str(tmp),
            "XDG_CONFIG_HOME": os.path.join(home, ".config"),
            "XDG_DATA_HOME": os.path.join(home, ".local", "share"),
            "XDG_STATE_HOME": os.path.join(home, ".local", "state"),
            "XDG_CACHE_HOME": os.path.join(home, ".cache"),
        }
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, argv, env):
        try:
            p = subprocess.run(
                argv,
                cwd=self.work,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=CLIENT_TIMEOUT,
            )
            self.rc, self.out, self.err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            self.rc = f"none: killed after {CLIENT_TIMEOUT} s"
            self.out, self.err = as_text(e.stdout), as_text(e.stderr)
        finally:
            self.server.stop()
        if os.environ.get("UPDATE_FIXTURES"):
            self.save_fixture()

    def requests(self):
        return self.server.requests()

    def report(self):
        """What happened, for a failure's message."""
        lines = [f"{self.name}: exit {self.rc}"]
        for r in self.requests():
            body = json.dumps(r["body"])
            lines.append(
                f"  {r['method']} {r['path']} {len(body)} bytes"
                f"{' (holds the tool result)' if self.marker in body else ''}"
            )
        lines.append("--- client stdout (tail)\n" + self.out[-3000:])
        lines.append("--- client stderr (tail)\n" + self.err[-3000:])
        lines.append("--- server stderr (tail)\n" + "".join(self.server.stderr)[-3000:])
        return "\n".join(lines)

    def check_round_trip(self):
        """Exit 0, the final answer printed, the tool result sent back."""
        assert self.rc == 0, self.report()
        posts = [r for r in self.requests() if r["method"] == "POST"]
        assert posts, "the client sent no request\n" + self.report()
        assert any(self.marker in json.dumps(r["body"]) for r in posts), (
            "the tool result never reached the server\n" + self.report()
        )
        assert self.answer in self.out, (
            "the final answer is not in the client's output\n" + self.report()
        )

    def save_fixture(self):
        posts = [r for r in self.requests() if r["method"] == "POST" and isinstance(r["body"], dict)]
        with_result = [r for r in posts if self.marker in json.dumps(r["body"])]
        main = [r for r in posts if r["body"].get("tools")]
        pick = (with_result or main or posts or [None])[-1 if with_result else 0]
        if pick is None:
            return
        os.makedirs(FIXTURES, exist_ok=True)
        with open(os.path.join(FIXTURES, f"{self.name}.json"), "w") as f:
            json.dump({"path": pick["path"], "body": trimmed(pick["body"])}, f, indent=1)
            f.write("\n")


def as_text(output):
    """What a timed-out child wrote (bytes, or None when nothing)."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def trimmed(body, limit=FIXTURE_MAX_BYTES):
    """`body` with its longest strings cut until it fits in `limit` bytes
    of JSON; keys, lists and the order of everything are kept."""
    body = json.loads(json.dumps(body))

    def strings(v, out):
        if isinstance(v, dict):
            for k in v:
                if isinstance(v[k], str):
                    out.append((v, k))
                else:
                    strings(v[k], out)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, str):
                    out.append((v, i))
                else:
                    strings(x, out)
        return out

    while len(json.dumps(body)) > limit:
        holder, key = max(strings(body, []), key=lambda hk: len(hk[0][hk[1]]))
        s = holder[key]
        if len(s) <= 200:
            break
        holder[key] = s[: len(s) // 2] + " [trimmed]"
    return body


@pytest.fixture
def trip(request, tmp_path):
    return Trip(tmp_path, request.node.name.removeprefix("test_"))


def test_claude(trip):
    """Claude Code (Anthropic Messages API): its Bash tool."""
    s = trip.serve(
        tool_call("Bash", command="cat note.txt", description="Show the note"),
        # Claude Code asks for its own model names in side requests.
        extra_args=["--any-model"],
    )
    env = trip.env(
        ANTHROPIC_BASE_URL=s.base,
        ANTHROPIC_API_KEY="slipstream-test",
        ANTHROPIC_MODEL="demo",
        DISABLE_TELEMETRY=1,
        DISABLE_AUTOUPDATER=1,
        DISABLE_ERROR_REPORTING=1,
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1,
    )
    trip.run(
        [client_bin("claude"), "-p", trip.prompt(), "--model", "demo", "--allowedTools", "Bash"],
        env,
    )
    trip.check_round_trip()


def test_codex(trip):
    """Codex CLI (OpenAI Responses API): its exec_command tool."""
    s = trip.serve(tool_call("exec_command", cmd="cat note.txt"))
    codex_home = trip.home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        f"""model = "demo"
model_provider = "slipstream"
check_for_update_on_startup = false

[model_providers.slipstream]
name = "slipstream"
base_url = "{s.base}/v1"
wire_api = "responses"

[analytics]
enabled = false

[feedback]
enabled = false

# These fetch plugin and app lists from GitHub and chatgpt.com.
[features]
plugins = false
remote_plugin = false
apps = false
"""
    )
    env = trip.env(CODEX_HOME=codex_home)
    trip.run(
        [
            client_bin("codex"),
            "exec",
            "--skip-git-repo-check",
            # The sandbox needs kernel features CI machines may lack; what
            # is tested here is the server.
            "--sandbox",
            "danger-full-access",
            trip.prompt(),
        ],
        env,
    )
    trip.check_round_trip()


def test_qwen(trip):
    """Qwen Code (OpenAI Chat Completions): its run_shell_command tool."""
    s = trip.serve(tool_call("run_shell_command", command="cat note.txt"))
    settings = trip.home / ".qwen" / "settings.json"
    settings.parent.mkdir()
    settings.write_text(
        json.dumps(
            {
                "privacy": {"usageStatisticsEnabled": False},
                "telemetry": {"enabled": False},
                "general": {"enableAutoUpdate": False},
            }
        )
    )
    env = trip.env(OPENAI_BASE_URL=f"{s.base}/v1", OPENAI_API_KEY="slipstream-test", OPENAI_MODEL="demo")
    # --yolo: run the shell tool without asking (nobody is there to ask).
    trip.run([client_bin("qwen"), "-p", trip.prompt(), "--yolo"], env)
    trip.check_round_trip()


def test_opencode(trip):
    """opencode (OpenAI Chat Completions through @ai-sdk/openai-compatible,
    which opencode bundles): its bash tool."""
    s = trip.serve(tool_call("bash", command="cat note.txt", description="Show the note"))
    config = trip.home / "opencode.json"
    config.write_text(
        json.dumps(
            {
                "$schema": "https://opencode.ai/config.json",
                "provider": {
                    "slipstream": {
                        "npm": "@ai-sdk/openai-compatible",
                        "name": "slipstream",
                        "options": {"baseURL": f"{s.base}/v1", "apiKey": "slipstream-test"},
                        "models": {"demo": {"name": "demo"}},
                    }
                },
                "model": "slipstream/demo",
                "small_model": "slipstream/demo",
                "autoupdate": False,
                "share": "disabled",
            }
        )
    )
    env = trip.env(
        OPENCODE_CONFIG=config,
        OPENCODE_DISABLE_AUTOUPDATE=1,
        OPENCODE_DISABLE_MODELS_FETCH=1,
        OPENCODE_DISABLE_LSP_DOWNLOAD=1,
        OPENCODE_DISABLE_DEFAULT_PLUGINS=1,
        # opencode installs its plugin package into its config directory in
        # the background, through npm's config: offline, that just fails.
        npm_config_offline="true",
    )
    trip.run([client_bin("opencode"), "run", trip.prompt()], env)
    trip.check_round_trip()


def test_aider(trip):
    """aider (OpenAI Chat Completions through litellm): no tools; its edit
    format is SEARCH/REPLACE blocks in the reply's text."""
    edited = trip.marker.replace("tool-result", "edited")
    edit = (
        "note.txt\n```\n<<<<<<< SEARCH\n"
        f"{trip.marker}\n=======\n{edited}\n>>>>>>> REPLACE\n```\n"
        f"The note has been edited. {trip.answer}"
    )
    # The note's contents (the marker) reach the model only as aider sends
    # the file: the edit answers exactly that prompt.
    s = trip.serve(edit, main_turn=[trip.marker])
    # aider would fetch model metadata from GitHub without this.
    metadata = trip.home / "model-metadata.json"
    metadata.write_text(
        json.dumps(
            {
                "openai/demo": {
                    "max_input_tokens": 262144,
                    "max_output_tokens": 8192,
                    "input_cost_per_token": 0,
                    "output_cost_per_token": 0,
                    "litellm_provider": "openai",
                    "mode": "chat",
                }
            }
        )
    )
    # litellm (aider's client library) would fetch its model price list.
    env = trip.env(LITELLM_LOCAL_MODEL_COST_MAP="True")
    trip.run(
        [
            os.environ.get("AIDER") or pytest.skip("AIDER is not set (run tests/clients/run.sh)"),
            "--model", "openai/demo",
            "--openai-api-base", f"{s.base}/v1",
            "--openai-api-key", "slipstream-test",
            "--model-metadata-file", str(metadata),
            "--edit-format", "diff",
            "--no-git",
            "--no-check-update",
            "--no-analytics",
            "--no-show-model-warnings",
            "--no-auto-lint",
            "--no-pretty",
            "--no-fancy-input",
            "--yes-always",
            "--message", f"In note.txt, replace the marker with an edited one. ({trip.task})",
            "note.txt",
        ],
        env,
    )
    # aider exits 0 even when the request fails: the edit is the proof.
    assert trip.rc == 0, trip.report()
    assert (trip.work / "note.txt").read_text().strip() == edited, trip.report()
    assert trip.answer in trip.out, trip.report()
