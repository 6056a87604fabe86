"""Pull the ServerApp's replies from the SuperLink within a byte budget per reply.

Flower 1.41's ``HttpGrid.pull_messages`` downloads every object of a reply (the message, its records,
each ``Array``'s header and its chunks of up to 5 MiB) into memory before anything can look at the
reply's size, then joins the chunks into the array's bytes. Chunks are deduplicated by id and an
``Array`` header lists them by position, so a reply whose chunks repeat can also inflate far beyond
what was uploaded (256 MiB from one 5 MiB chunk). So a client could make the ServerApp hold any amount
of memory before ``runtime.max_payload_mb`` was checked.

:class:`BoundedPull` pulls the same replies through the same Runtime API (the ServerApp's own
address, TLS and token) but:

1. reads the ``PullMessages`` answer as a stream and refuses a reply whose object tree (ids only)
   is larger than a tree of a reply within the budget can be, without losing the other replies;
2. pulls a reply's objects one at a time, parents before children, so every ``Array`` header (dtype
   and shape) is read before its chunks: arrays that declare more than ``max_bytes`` in all refuse
   the reply before any chunk is downloaded;
3. reads each object as a stream and refuses the reply before reading an object that would take the
   reply's downloads past ``max_bytes`` plus :data:`OBJECT_OVERHEAD` (a sender that lies about a
   shape, or makes one huge chunk);
4. once the chunks are in, checks that the chunks listed by each ``Array`` add up to its declared
   size (what the array would inflate to), which refuses the repeated-chunk reply;
5. confirms every pulled reply to the SuperLink, refused ones included, so it drops its copy.

A refused reply costs the ServerApp at most about ``max_bytes`` + :data:`OBJECT_OVERHEAD` bytes.
The Flower internals this relies on (the HttpGrid's fields, the object and ``Array`` formats, the
protobuf field numbers read here) are in :mod:`.internals` and checked by test_flower_internals.py.
Only an ``HttpGrid`` (the deployment engine's ServerApp) can be pulled this way: the simulation
engine's in-memory Grid hands the ServerApp reply objects that already exist in its process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import httpx
import numpy as np
from flwr.app import Message

from fedpeft.errors import first_line
from fedpeft.runtime.flower.internals import (
    ConfirmMessageReceivedRequest,
    HttpGrid,
    MessageProto,
    ObjectTree,
    ProtobufRequestContext,
    PullAppMessagesRequest,
    PullObjectRequest,
    get_object_head_values_from_object_content,
    grid_run_id,
    http_client_of,
    inflate_object_from_contents,
    object_body_size,
    read_array_header,
    runtime_client_for,
)

log = logging.getLogger("fedpeft")
OBJECT_OVERHEAD = 1 << 20  # a reply's objects beyond its arrays: object heads, records, metadata
MESSAGE_PROTO_LIMIT = 64 << 10  # one reply's message proto (metadata, error) in the PullMessages answer
ERROR_BODY_LIMIT = 64 << 10  # an HTTP error answer
PULL_MESSAGES = "/flwr.proto.Runtime/PullMessages"
PULL_OBJECT = "/flwr.proto.Runtime/PullObject"
# protobuf wire types and the field numbers read here (checked against Flower's protos in the tests)
VARINT, LENGTH_DELIMITED = 0, 2
MESSAGES_FIELD, TREES_FIELD = 1, 2  # PullAppMessagesResponse.messages_list, .message_object_trees
FOUND_FIELD, AVAILABLE_FIELD, CONTENT_FIELD = 1, 2, 3  # PullObjectResponse


class ReplyRefused(Exception):
    """A reply that may not be pulled; the message says why (one line)."""


class ReplyTooLarge(ReplyRefused):
    """A reply refused for its size."""


def tree_limit(max_bytes: int) -> int:
    """The most bytes the object tree of a reply within ``max_bytes`` needs: ~70 bytes per object, and an
    array of n bytes has n / 5 MiB chunks (Flower's default chunk size); this allows 1 KiB per MiB."""
    return (64 << 10) + max_bytes // 1024


# -- reading protobuf answers as streams ------------------------------------------------------------


class WireStream:
    """The protobuf wire format of one message, read from a stream of byte pieces without holding it whole."""

    def __init__(self, pieces: Iterable[bytes]):
        self._pieces = iter(pieces)
        self._buffer = bytearray()

    def _fill(self, n: int) -> bool:
        while len(self._buffer) < n:
            piece = next(self._pieces, None)
            if piece is None:
                return False
            self._buffer += piece
        return True

    def at_end(self) -> bool:
        return not self._fill(1)

    def varint(self) -> int:
        value = shift = 0
        while True:
            if not self._fill(1) or shift > 63:
                raise ReplyRefused("a malformed protobuf answer from the SuperLink")
            byte = self._buffer.pop(0)
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    def field(self) -> tuple[int, int]:
        """(field number, wire type) of the next field."""
        key = self.varint()
        return key >> 3, key & 7

    def read(self, n: int) -> bytearray:
        """The next ``n`` bytes, in one buffer allocated once (the caller has checked that n is affordable)."""
        out = bytearray(n)
        with memoryview(out) as view:
            filled = 0
            while filled < n:
                if not self._buffer and not self._fill(1):
                    raise ReplyRefused("a truncated protobuf answer from the SuperLink")
                take = min(n - filled, len(self._buffer))
                view[filled:filled + take] = self._buffer[:take]
                del self._buffer[:take]
                filled += take
        return out

    def skip(self, wire_type: int) -> None:
        """Pass over a field's value without keeping it."""
        if wire_type == VARINT:
            self.varint()
            return
        if wire_type != LENGTH_DELIMITED:
            raise ReplyRefused(f"an unexpected protobuf wire type {wire_type} in an answer from the SuperLink")
        left = self.varint()
        while left:
            if not self._buffer and not self._fill(1):
                raise ReplyRefused("a truncated protobuf answer from the SuperLink")
            take = min(left, len(self._buffer))
            del self._buffer[:take]
            left -= take


@dataclass
class PulledObject:
    found: bool = False
    available: bool = False
    content: bytes | bytearray = b""


def read_object_answer(pieces: Iterable[bytes], limit: int) -> PulledObject:
    """A PullObject answer; ReplyRefused, before its content is read, if the content exceeds ``limit`` bytes."""
    stream, out = WireStream(pieces), PulledObject()
    while not stream.at_end():
        number, wire_type = stream.field()
        if number in (FOUND_FIELD, AVAILABLE_FIELD) and wire_type == VARINT:
            setattr(out, "found" if number == FOUND_FIELD else "available", bool(stream.varint()))
        elif number == CONTENT_FIELD and wire_type == LENGTH_DELIMITED:
            size = stream.varint()
            if size > limit:
                raise ReplyTooLarge(f"it needs more than the {limit} bytes left of its budget (an object of {size} "
                                   "bytes)")
            out.content = stream.read(size)
        else:
            stream.skip(wire_type)
    return out


@dataclass
class PulledReply:
    """One reply of a PullMessages answer: its message proto and object tree, or why its tree was refused."""

    proto: MessageProto
    tree: ObjectTree | None
    refused: ReplyRefused | None = None


def read_messages_answer(pieces: Iterable[bytes], max_items: int, tree_bytes: int) -> list[PulledReply]:
    """A PullMessages answer, each item checked on its own: a message proto over :data:`MESSAGE_PROTO_LIMIT`
    or unreadable is dropped (it cannot be named; its reply times out), a tree over ``tree_bytes`` or
    unreadable refuses that reply only. At most ``max_items`` items of each kind are kept."""
    stream = WireStream(pieces)
    protos: list[MessageProto | None] = []
    trees: list[ObjectTree | ReplyRefused] = []
    while not stream.at_end():
        number, wire_type = stream.field()
        if wire_type != LENGTH_DELIMITED or number not in (MESSAGES_FIELD, TREES_FIELD):
            stream.skip(wire_type)
            continue
        size = stream.varint()
        items: list = protos if number == MESSAGES_FIELD else trees
        limit = MESSAGE_PROTO_LIMIT if number == MESSAGES_FIELD else tree_bytes
        if size > limit or len(items) >= max_items:
            _skip_bytes(stream, size)
            items.append(None if number == MESSAGES_FIELD else ReplyTooLarge(
                f"its object tree has {size} bytes, more than the {limit} a reply within the budget needs"))
            continue
        data = bytes(stream.read(size))
        try:
            items.append(MessageProto.FromString(data) if number == MESSAGES_FIELD else ObjectTree.FromString(data))
        except Exception:  # protobuf's DecodeError and its recursion limit; the item alone is dropped  # noqa: BLE001
            items.append(None if number == MESSAGES_FIELD else ReplyRefused("its object tree cannot be read"))
    replies = []
    for proto, tree in zip(protos, trees):
        if proto is not None:
            refused = tree if isinstance(tree, ReplyRefused) else None
            replies.append(PulledReply(proto, None if refused else tree, refused))  # type: ignore[arg-type]
    return replies


def _skip_bytes(stream: WireStream, size: int) -> None:
    while size:
        take = min(size, 1 << 20)
        stream.read(take)
        size -= take


# -- the HTTP side ------------------------------------------------------------------------------------


class StreamedCall:
    """Innermost interceptor of the Runtime API client: the call armed with :meth:`arm` is sent streamed and
    its answer's body goes to the armed reader; its result is in :attr:`result` (the client itself gets an
    empty body). Other calls pass through."""

    def __init__(self) -> None:
        self.http: httpx.Client | None = None
        self._armed: tuple[str, Callable[[Iterator[bytes]], object]] | None = None
        self.result: object = None

    def arm(self, rpc_method: str, reader: Callable[[Iterator[bytes]], object]) -> None:
        self._armed, self.result = (rpc_method, reader), None

    def take(self) -> object:
        """The armed call's result; disarms."""
        result, self._armed, self.result = self.result, None, None
        return result

    def intercept(self, context: ProtobufRequestContext,
                  call_next: Callable[[ProtobufRequestContext], httpx.Response]) -> httpx.Response:
        if self._armed is None or context.rpc_method != self._armed[0] or self.http is None:
            return call_next(context)
        reader = self._armed[1]
        response = self.http.send(context.request, stream=True)
        try:
            body = b""
            if response.is_error:  # for Flower's own status handling and retries
                body = _read_at_most(response.iter_bytes(), ERROR_BODY_LIMIT)
            else:
                self.result = reader(response.iter_bytes())
        finally:
            response.close()
        headers = [(k, v) for k, v in response.headers.multi_items() if k not in ("content-length", "content-encoding")]
        return httpx.Response(response.status_code, headers=headers, content=body, request=context.request)


def _read_at_most(pieces: Iterator[bytes], limit: int) -> bytes:
    out = bytearray()
    for piece in pieces:
        out += piece[:limit - len(out)]
        if len(out) >= limit:
            break
    return bytes(out)


class BoundedPull:
    """Pulls replies to the messages an ``HttpGrid`` pushed, each within its own byte budget."""

    def __init__(self, grid: HttpGrid, poll_s: float = 0.05):
        self.grid = grid
        self.poll_s = poll_s
        self.streamed = StreamedCall()
        self.client = runtime_client_for(grid, [self.streamed])
        self.streamed.http = http_client_of(self.client)

    def pull(self, max_bytes: Mapping[str, int], deadline: float) -> tuple[dict[str, Message],
                                                                           dict[str, ReplyRefused]]:
        """The replies available now to the messages ``max_bytes`` names (message id -> the most bytes the
        arrays of its reply may hold): ({message id: its reply}, {message id: why its reply was refused}),
        by the message each reply answers as the SuperLink checked it. A reply's objects still uploading are
        waited for until ``deadline`` (time.monotonic)."""
        ids = sorted(max_bytes)
        largest = max(max_bytes.values(), default=0)
        self.streamed.arm(PULL_MESSAGES, lambda pieces: read_messages_answer(pieces, len(ids), tree_limit(largest)))
        try:
            self.client.PullMessages(PullAppMessagesRequest(message_ids=ids))
        except ReplyRefused as exc:  # an answer cut short: its replies are lost, as with Flower's own pull
            log.warning("pulling replies from the SuperLink failed: %s", exc)
        pulled: list[PulledReply] = self.streamed.take() or []  # type: ignore[assignment]
        accepted: dict[str, Message] = {}
        refused: dict[str, ReplyRefused] = {}
        for reply in pulled:
            answers = reply.proto.metadata.reply_to_message_id
            message_id = reply.proto.metadata.message_id
            try:
                if answers not in max_bytes:
                    continue  # not asked for here: dropped (confirmed below)
                if reply.refused is not None:
                    raise reply.refused
                contents = self._pull_objects(reply.tree, max_bytes[answers], deadline)  # type: ignore[arg-type]
                message = _rebuild(message_id, contents)
                if message.metadata.reply_to_message_id != answers:
                    raise ReplyRefused("its content names another message than the one it answers")
                accepted[answers] = message
            except ReplyRefused as exc:
                refused[answers] = exc
            finally:
                self._confirm(message_id)
        return accepted, refused

    def _confirm(self, message_id: str) -> None:
        self.client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(
            node=self.grid.node, run_id=grid_run_id(self.grid), message_object_id=message_id))

    def _pull_objects(self, tree: ObjectTree, max_bytes: int, deadline: float) -> dict[str, bytes | bytearray]:
        """Every object of one reply, by id; ReplyRefused as soon as the reply is known to exceed its budget."""
        budget = max_bytes + OBJECT_OVERHEAD
        contents: dict[str, bytes | bytearray] = {}
        arrays: list[tuple[int, tuple[str, ...]]] = []  # (declared bytes, chunk id at each position)
        declared = downloaded = 0
        for object_id in _parents_first(tree):
            if object_id in contents:
                continue
            content = self._pull_object(object_id, budget - downloaded, deadline)
            downloaded += len(content)
            contents[object_id] = content
            kind = _object_kind(content)
            if kind == "Array":
                size, chunks = _array_layout(content)
                declared += size
                if declared > max_bytes:
                    raise ReplyTooLarge(f"its arrays hold {declared} bytes, more than the {max_bytes} allowed")
                arrays.append((size, chunks))
        for size, chunks in arrays:  # what Array.inflate would build, from the chunks actually received
            built = sum(object_body_size(contents[c]) for c in chunks if c in contents)
            if built != size or not all(c in contents for c in chunks):
                raise ReplyTooLarge(f"an array declares {size} bytes but its chunks make {built}")
        return contents

    def _pull_object(self, object_id: str, limit: int, deadline: float) -> bytes | bytearray:
        while True:
            self.streamed.arm(PULL_OBJECT, lambda pieces: read_object_answer(pieces, limit))
            self.client.PullObject(PullObjectRequest(node=self.grid.node, run_id=grid_run_id(self.grid),
                                                     object_id=object_id))
            answer: PulledObject = self.streamed.take()  # type: ignore[assignment]
            if answer is None or not answer.found:
                raise ReplyRefused(f"its object {object_id[:16]} is not on the SuperLink")
            if answer.available:
                return answer.content
            if time.monotonic() > deadline:
                raise ReplyRefused("its objects did not all reach the SuperLink in time")
            time.sleep(self.poll_s)


def _rebuild(message_id: str, contents: dict[str, bytes | bytearray]) -> Message:
    """The reply Message from its objects, as Flower's HttpGrid builds it; ReplyRefused if they do not make one."""
    try:
        message = inflate_object_from_contents(message_id, contents)
    except Exception as exc:  # a sender's objects that do not fit together, whatever Flower raises  # noqa: BLE001
        raise ReplyRefused(f"its objects do not make a message ({type(exc).__name__}: {first_line(exc, 80)})") from None
    if not isinstance(message, Message):
        raise ReplyRefused(f"its root object is a {type(message).__name__}, not a Message")
    message.metadata.__dict__["_message_id"] = message_id  # as Flower's HttpGrid does
    return message


def _parents_first(tree: ObjectTree) -> Iterator[str]:
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node.object_id
        stack.extend(reversed(node.children))


def _object_kind(content: bytes | bytearray) -> str:
    try:
        return get_object_head_values_from_object_content(content)[0]
    except (ValueError, UnicodeDecodeError):
        raise ReplyRefused("one of its objects has no readable head") from None


def _array_layout(content: bytes | bytearray) -> tuple[int, tuple[str, ...]]:
    """(bytes the Array declares: its shape's size times its dtype's itemsize, chunk id at each position)."""
    try:
        header = read_array_header(content)
        itemsize = np.dtype(header.dtype).itemsize
    except (ValueError, TypeError) as exc:
        raise ReplyRefused(f"an array header that cannot be read ({first_line(exc, 80)})") from None
    size = itemsize
    for dim in header.shape:
        size *= dim
    return size, header.chunk_ids
