"""Every part of an execution's output is capped, and whatever the kernel sends is handled.

The sandboxed code holds the kernel's HMAC key, so it can put anything on the output channel:
forged messages of any shape, replays, bad signatures, bad JSON, messages too big to take. Each
is either used (when it is well formed and belongs to the run) or dropped with a note; none may
fail the request or the service.
"""

from __future__ import annotations

import asyncio

from code_interpreter_wire.results import ErrorEvent, ExecutionStatus, OutputEvent
from sandbox import Backend, Sandbox
from tests.conftest import small_spec

MB = 1_000_000


async def test_a_huge_exception_message_is_capped(sandbox: Sandbox, bystander: Sandbox) -> None:
    events: list[OutputEvent] = []

    async def sink(event: OutputEvent) -> None:
        events.append(event)

    ex = await sandbox.execute(
        "raise ValueError('head' + 'v' * (60 * 1000 * 1000) + 'tail')", timeout_s=120, on_event=sink
    )
    assert ex.status is ExecutionStatus.ERROR
    assert ex.error is not None and ex.error.name == "ValueError"
    assert ex.error.value.startswith("head") and ex.error.value.endswith("tail")
    assert "characters of the error value dropped" in ex.error.value
    assert len(ex.error.value) < 1_100_000
    assert len(ex.error.traceback) < 1_100_000
    assert len(ex.model_dump_json()) < 3 * MB
    streamed = [e for e in events if isinstance(e, ErrorEvent)]
    assert streamed and all(len(e.model_dump_json()) < 3 * MB for e in streamed)
    assert (await sandbox.execute("1 + 1")).text == "2"


async def test_a_huge_traceback_is_capped(sandbox: Sandbox, bystander: Sandbox) -> None:
    ex = await sandbox.execute(
        "class Loud(Exception):\n"
        "    def _render_traceback_(self):\n"
        "        return ['first line'] + ['frame ' + 'f' * 1000] * 50_000 + ['last line']\n"
        "raise Loud('x')",
        timeout_s=120,
    )
    assert ex.status is ExecutionStatus.ERROR
    assert ex.error is not None
    assert ex.error.traceback.startswith("first line")
    assert ex.error.traceback.endswith("last line")
    assert "characters of the traceback dropped" in ex.error.traceback
    assert len(ex.error.traceback) < 1_100_000


async def test_a_giant_unknown_mime_key_counts(sandbox: Sandbox, bystander: Sandbox) -> None:
    events: list[OutputEvent] = []

    async def sink(event: OutputEvent) -> None:
        events.append(event)

    ex = await sandbox.execute(
        "from IPython.display import display\n"
        "display({'text/plain': 'a', 'application/x-' + 'k' * (60 * 1000 * 1000): ''}, raw=True)\n"
        "display({'text/plain': 'small'}, raw=True)",
        timeout_s=120,
        on_event=sink,
    )
    assert ex.ok, ex.error
    assert ex.results_dropped == 1
    assert ex.results[0].text is not None and "was left out" in ex.results[0].text
    assert ex.results[1].text == "small"
    assert len(ex.model_dump_json()) < 1 * MB
    assert all(len(e.model_dump_json()) < 1 * MB for e in events)


async def test_thousands_of_mime_keys_are_refused(sandbox: Sandbox, bystander: Sandbox) -> None:
    ex = await sandbox.execute(
        "from IPython.display import display\n"
        "display({f'application/x-{i}': '' for i in range(20_000)}, raw=True)",
        timeout_s=120,
    )
    assert ex.ok, ex.error
    assert ex.results_dropped == 1
    assert len(ex.results) == 1 and ex.results[0].text is not None
    assert "was left out" in ex.results[0].text
    assert len(ex.model_dump_json()) < 100_000


# Sends, from inside the kernel, on its own output channel, with the current run as parent.
FORGE = """
import json
k = get_ipython().kernel
s, sock, parent = k.session, k.iopub_socket, k.get_parent()
def forge(kind, content):
    s.send(sock, kind, content, parent=parent)
def frames(kind, content):
    return s.serialize(s.msg(kind, content, parent=parent))
forge('stream', '[1, 2]')  # content as already-encoded JSON
forge('stream', {'name': 'stdout', 'text': 123})
forge('stream', {'name': 7, 'text': None})
forge('display_data', {'data': 'not a dict'})
forge('display_data', {'data': {'text/plain': 5}, 'metadata': []})
forge('display_data', {'data': {7: 'x'}})
forge('execute_result', {'data': None, 'execution_count': 'x'})
forge('error', {'ename': 1, 'evalue': None, 'traceback': 'not a list'})
forge('error', {'ename': 'E', 'evalue': 'v', 'traceback': [1, None]})
forge('execute_input', {'execution_count': 'x'})
forge('status', {'execution_state': 5})
forge('clear_output', '"x"')
forge('display_data', '{"data": ' * 5000)
replayed = frames('stream', {'name': 'stdout', 'text': 'replayed\\n'})
sock.send_multipart(replayed)
sock.send_multipart(replayed)
bad_signature = list(replayed)
bad_signature[1] = b'0' * 64
sock.send_multipart(bad_signature)
bad_json = frames('stream', {'name': 'stdout', 'text': 'z'})
bad_json[5] = b'{not json'
bad_json[1] = s.sign(bad_json[2:6])
sock.send_multipart(bad_json)
not_object = frames('stream', {})
not_object[2] = b'[]'
not_object[1] = s.sign(not_object[2:6])
sock.send_multipart(not_object)
sock.send_multipart([b'<IDS|MSG>'])
sock.send_multipart([b'no delimiter at all'])
import time; time.sleep(0.5)
print('after the forgeries')
"""


async def test_forged_kernel_messages_are_handled_or_dropped(
    sandbox: Sandbox, bystander: Sandbox
) -> None:
    events: list[OutputEvent] = []

    async def sink(event: OutputEvent) -> None:
        events.append(event)

    ex = await sandbox.execute(FORGE, timeout_s=60, on_event=sink)
    assert ex.status in (ExecutionStatus.OK, ExecutionStatus.ERROR), ex
    assert "after the forgeries" in ex.stdout
    assert ex.notice is not None and "malformed" in ex.notice, ex.notice
    again = await sandbox.execute("1 + 1")
    assert again.ok and again.text == "2", again


async def test_a_message_too_big_to_take_does_not_end_the_run(
    backend: Backend, bystander: Sandbox
) -> None:
    async with await backend.create(small_spec()) as sb:
        ex = await sb.execute(
            "k = get_ipython().kernel\n"
            "frames = k.session.serialize(k.session.msg('stream', {}, parent=k.get_parent()))\n"
            "frames[5] = b'\"' + b'x' * (300 << 20) + b'\"'\n"
            "frames[1] = k.session.sign(frames[2:6])\n"
            "k.iopub_socket.send_multipart(frames)\n"
            "del frames\n"
            # Published while the service reconnects, output would be lost: wait for it.
            "import time; time.sleep(5)\n"
            "print('still running')",
            timeout_s=120,
        )
        assert ex.status is ExecutionStatus.OK, ex.error
        assert "still running" in ex.stdout
        assert (await sb.execute("1 + 1")).text == "2"


async def test_a_finished_run_whose_idle_status_is_lost_is_not_a_timeout(
    sandbox: Sandbox, bystander: Sandbox
) -> None:
    # PUB/SUB drops messages when the reader falls behind (a run flooded with updates): here
    # the kernel drops its idle statuses itself. The shell's execute_reply still ends the run.
    ex = await sandbox.execute(
        "k = get_ipython().kernel\n"
        "publish = k._publish_status\n"
        "def without_idle(status, *args, **kwargs):\n"
        "    if status != 'idle':\n"
        "        publish(status, *args, **kwargs)\n"
        "k._publish_status = without_idle\n"
        "print('done')",
        timeout_s=10,
    )
    assert ex.status is ExecutionStatus.OK, (ex.status, ex.error)
    assert ex.stdout == "done\n"
    assert ex.notice and "end-of-output signal never came" in ex.notice
    # Between the reply and the end the code is over: an interrupt has nothing to stop.
    running = asyncio.ensure_future(sandbox.execute("print('next'); 1 + 1", timeout_s=10))
    await asyncio.sleep(0.5)
    assert not await sandbox.interrupt()
    again = await running
    assert again.status is ExecutionStatus.OK, (again.status, again.error)
    assert again.stdout == "next\n" and again.text == "2"
    assert not again.state_lost


async def test_a_deeply_nested_rich_output_is_left_out(sandbox: Sandbox) -> None:
    """JSON 300 deep from the kernel: pydantic cannot serialise past ~250 levels, so keeping it
    made every answer carrying the execution fail."""
    execution = await sandbox.execute(
        "deep = shallow = {}\n"
        "for _ in range(300):\n"
        "    shallow['x'] = {}\n"
        "    shallow = shallow['x']\n"
        "display({'application/json': deep, 'text/plain': 'deep'}, raw=True)\n"
        "display({'text/plain': 'after'}, raw=True)"
    )
    assert execution.ok, execution.error
    texts = [r.text or "" for r in execution.results]
    assert "nested deeper than" in texts[0] and texts[1] == "after", texts
    assert execution.results_dropped == 1
    execution.model_dump_json()  # the answer can be made
