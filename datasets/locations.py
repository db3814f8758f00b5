"""Where the project keeps its files: a local path, or an object-store URI ``s3://bucket/prefix``.

Shard stores, their partition reports and checkpoints are written and read through this module
only, so that a location is told apart once (``parse_location``) and every operation on it
(``join`` is ``/``, ``read_bytes``, ``exists``, ``write_atomic``, ``upload_folder``,
``open_input_file``, ``open_input_stream``) does the right thing on either kind.

S3 (or any S3-compatible server) is reached through pyarrow's ``S3FileSystem``, configured from
the standard AWS variables: ``AWS_ENDPOINT_URL`` (an endpoint other than AWS's, e.g. MinIO;
pyarrow's constructor does not read it itself), ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
or the AWS SDK's other credential sources, ``AWS_DEFAULT_REGION``. Its connect and request
timeouts are short and its retries few, so an unreachable endpoint fails in seconds. boto3,
resolved from the same variables (``s3_client``), makes the server-side copies (``copy_object``:
multipart above ``MULTIPART_COPY_THRESHOLD``, as S3 copies at most 5 GiB in one request) and
the write probe (``check_writable``).

A URI never reaches a key outside its prefix: its bucket and every segment of its key are
checked (no empty segment, no ``.`` or ``..``) when it is parsed, when it is joined and again
before any request (``ObjectLocation.path``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

SCHEMES = ("s3",)
CONNECT_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 20.0  # between bytes of a response, not for a whole download
ATTEMPTS = 3  # per request: the first and two retries
# ``write_atomic``'s server-side copy: one CopyObject below the threshold (S3 refuses one above
# 5 GiB), else a multipart copy of parts of MULTIPART_COPY_CHUNK bytes (UploadPartCopy, several
# at once; S3 allows 10,000 parts, s3transfer grows the parts to fit). A part is copied inside
# the server before it answers: COPY_TIMEOUT_S is the wait for that answer.
MULTIPART_COPY_THRESHOLD = 256 * 2**20
MULTIPART_COPY_CHUNK = 64 * 2**20
COPY_TIMEOUT_S = 300.0
PROBE_PREFIX = ".dpfl-write-probe-"
# S3-compatible servers differ: lenient, but a name begins and ends with a letter or digit and
# has no '..': '.' and '..' would be path segments to the client (s3://../other/k read the
# bucket "other": a review found).
_BUCKET = re.compile(r"(?!.*\.\.)[A-Za-z0-9](?:[A-Za-z0-9._-]{0,253}[A-Za-z0-9])?")


class LocationError(ValueError):
    """A location that is malformed or cannot be reached. ``variable`` is the environment
    variable at fault (a credential or the endpoint), None when the location itself is;
    ``value`` is what it holds, ``problem`` the reason and the fix."""

    def __init__(self, problem: str, variable: str | None = None, value: str | None = None):
        self.problem, self.variable, self.value = problem, variable, value
        super().__init__(problem)

    def __reduce__(self):  # as Ray sends it from an actor: fields, then later state
        return (self.__class__, (self.problem, self.variable, self.value), self.__dict__)


@dataclass(frozen=True)
class ObjectLocation:
    """An object key (or key prefix) in a bucket: ``s3://bucket/key``. ``/`` joins like
    ``Path``'s; ``str`` gives the URI back."""

    bucket: str
    key: str = ""  # "" is the bucket itself; never a leading or trailing "/"
    scheme: str = "s3"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}".rstrip("/")

    def __truediv__(self, name: str | os.PathLike) -> ObjectLocation:
        """The key ``name`` (a name or a relative path) under this one, unchecked: ``path``
        and ``check`` refuse what would leave the prefix."""
        tail = PurePosixPath(os.fspath(name)).as_posix()
        return ObjectLocation(self.bucket, f"{self.key}/{tail}" if self.key else tail, self.scheme)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectLocation:
        return ObjectLocation(self.bucket, self.key.rpartition("/")[0], self.scheme)

    def is_absolute(self) -> bool:
        """A URI names the same place wherever it is read (as an absolute path does)."""
        return True

    def check(self) -> None:
        """A ``LocationError`` when the bucket is empty or a key segment is empty, ``.`` or
        ``..`` (which S3 keeps literally, but a reader of the key would not)."""
        if not self.bucket or "/" in self.bucket:
            raise LocationError(f"no bucket in {self}; write {self.scheme}://BUCKET/PREFIX")
        if "@" in self.bucket or (":" in self.bucket and "@" in self.key):  # never echoed
            raise LocationError(
                "the URI holds credentials (USER:SECRET@ before the bucket); give them in "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or another AWS credential "
                f"source), never in the URI: {self.scheme}://BUCKET/PREFIX"
            )
        if ":" in self.bucket:
            raise LocationError(
                "a bucket name has no ':' (an endpoint, HOST:PORT, goes in AWS_ENDPOINT_URL, "
                f"e.g. http://minio:9000): write {self.scheme}://BUCKET/PREFIX"
            )
        if not _BUCKET.fullmatch(self.bucket):
            raise LocationError(
                f"the bucket {self.bucket!r} is no bucket name (letters, digits, '.', '-' and "
                "'_', beginning and ending with a letter or digit, no '..'; S3's are 3-63 "
                f"lowercase ones), e.g. {self.scheme}://dpfl/shards"
            )
        segments = self.key.split("/") if self.key else []
        bad = next((s for s in segments if s in ("", ".", "..")), None)
        if bad is not None:
            raise LocationError(
                f"the key {self.key!r} has {'an empty' if not bad else f'a {bad!r}'} segment; "
                "give a prefix of plain names separated by single slashes (e.g. "
                f"{self.scheme}://{self.bucket}/dpfl/shards)"
            )

    @property
    def path(self) -> str:
        """``bucket/key`` as pyarrow's S3 filesystem names it, after ``check``."""
        self.check()
        return f"{self.bucket}/{self.key}".rstrip("/")


Location = Path | ObjectLocation


def parse_location(text: str | os.PathLike | ObjectLocation) -> Location:
    """A local path (a plain path or ``file://``) or a checked ``ObjectLocation``; a
    ``LocationError`` for another scheme or a malformed URI. A trailing ``/`` is dropped."""
    if isinstance(text, ObjectLocation | Path):
        return text
    text = os.fspath(text)
    scheme, separator, rest = text.partition("://")
    if not separator:
        return Path(text)
    if scheme == "file":  # file:///ABSOLUTE/PATH (RFC 8089: the first segment is a host)
        host, _, path = rest.partition("/")
        path = unquote(path)
        if not path or "\0" in path:
            problem = "names no path" if not path else "holds a NUL character (%00)"
        elif host not in ("", "localhost"):
            problem = "names a host" if "@" in host else f"names the host {host!r}"
        else:
            return Path("/" + path)
        raise LocationError(
            f"the file:// URI {problem}; write file:///ABSOLUTE/PATH (three slashes) or the "
            "plain path"
        )
    if scheme not in SCHEMES:
        raise LocationError(
            f"the scheme {scheme!r} is not supported: give a local path or s3://BUCKET/PREFIX "
            "(Amazon S3 or any S3-compatible server, named by AWS_ENDPOINT_URL)"
        )
    bucket, _, key = rest.partition("/")
    location = ObjectLocation(bucket, key[:-1] if key.endswith("/") else key, scheme)
    location.check()
    return location


# ---------------------------------------------------------------------------- the S3 client


def s3_filesystem(
    attempts: int = ATTEMPTS, request_timeout: float = REQUEST_TIMEOUT_S
) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem from the AWS variables, with short timeouts and ``attempts``
    tries per request. Made per use: credentials and the endpoint are read when it is made."""
    return pafs.S3FileSystem(
        endpoint_override=os.environ.get("AWS_ENDPOINT_URL") or None,
        connect_timeout=CONNECT_TIMEOUT_S,
        request_timeout=request_timeout,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=attempts),
    )


def s3_client(read_timeout: float = REQUEST_TIMEOUT_S, attempts: int = ATTEMPTS):
    """A boto3 S3 client resolved as ``s3_filesystem`` is: ``AWS_ENDPOINT_URL`` (or AWS S3),
    the AWS SDK's credential chain and region, the same connect timeout and tries."""
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=read_timeout,
        retries={"max_attempts": attempts, "mode": "standard"},
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None, config=config
    )


def has_credentials() -> bool:
    """Whether the AWS credential chain (variables, shared files, a container or instance
    role) yields credentials, as botocore resolves it (it probes the instance-metadata address
    only where ``AWS_EC2_METADATA_DISABLED`` allows)."""
    import botocore.session

    return botocore.session.Session().get_credentials() is not None


def endpoint() -> str:
    """The S3 endpoint requests go to, for messages."""
    return os.environ.get("AWS_ENDPOINT_URL") or "AWS S3 (no AWS_ENDPOINT_URL)"


def check_access(location: ObjectLocation) -> None:
    """What a run needs of ``location``'s object store, checked in seconds before any work:
    credentials, an endpoint that answers (one TCP connect), the bucket (one request, no
    retry). A ``LocationError`` naming the variable at fault, or the location's bucket."""
    import botocore.exceptions

    try:
        found_credentials = has_credentials()
    except botocore.exceptions.BotoCoreError as error:  # e.g. AWS_PROFILE names no profile
        raise LocationError(
            f"the AWS credential chain failed ({error}); set AWS_PROFILE to a profile of the "
            "shared credentials file, or unset it and set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY",
            "AWS_PROFILE",
            os.environ.get("AWS_PROFILE", "(unset)"),
        ) from None
    if not found_credentials:
        raise LocationError(
            "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE with a shared credentials file, or run where an instance or pod role "
            "provides them)",
            "AWS_ACCESS_KEY_ID",
            "(unset)",
        )
    _check_endpoint_answers()
    try:
        probe = s3_filesystem(attempts=1, request_timeout=CONNECT_TIMEOUT_S)
        found = probe.get_file_info(location.bucket).type != pafs.FileType.NotFound
    except OSError as error:
        reason = str(error).splitlines()[0]
        raise LocationError(
            f"{endpoint()} refused or did not answer ({reason}); check AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL and AWS_DEFAULT_REGION"
        ) from None
    if not found:
        raise LocationError(
            f"the bucket {location.bucket!r} does not exist at {endpoint()}; create it (e.g. "
            f"`aws s3 mb s3://{location.bucket}`) or name an existing one"
        )


def _check_endpoint_answers() -> None:
    """``AWS_ENDPOINT_URL``, where set, is a URL whose host accepts a TCP connection."""
    url = os.environ.get("AWS_ENDPOINT_URL")
    if not url:
        return
    fix = "start the S3 server or correct AWS_ENDPOINT_URL (unset it for AWS S3)"
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as error:
        raise LocationError(f"not a URL ({error}); {fix}", "AWS_ENDPOINT_URL", url) from None
    if parts.scheme not in ("http", "https") or not host:
        raise LocationError(f"not an http(s)://HOST:PORT URL; {fix}", "AWS_ENDPOINT_URL", url)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return
    except OSError as error:
        reason = f"nothing answers at {host}:{port} ({error.strerror or error})"
        raise LocationError(f"{reason}; {fix}", "AWS_ENDPOINT_URL", url) from None


def check_writable(location: ObjectLocation) -> None:
    """These credentials may create and delete objects under the prefix ``location``: a small
    probe object is written there and deleted (two requests, no retry, short timeouts; boto3,
    which leaves no directory marker behind), so a read-only prefix is found before any work
    rather than at the first write. A ``LocationError`` with the reason and the fix; a probe
    that could not be deleted is left behind (its name says what it is)."""
    from botocore.exceptions import BotoCoreError, ClientError

    probe = location / f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    probe.check()
    client = s3_client(read_timeout=CONNECT_TIMEOUT_S, attempts=1)
    try:
        client.put_object(Bucket=probe.bucket, Key=probe.key, Body=b"dpfl write probe\n")
    except (BotoCoreError, ClientError) as error:
        raise LocationError(
            f"these credentials cannot write under {location} at {endpoint()} "
            f"({first_line(error)}); grant them s3:PutObject and s3:DeleteObject on "
            f"{location}/* (or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
            "to credentials that have them), or choose a prefix they may write"
        ) from None
    try:
        client.delete_object(Bucket=probe.bucket, Key=probe.key)
    except (BotoCoreError, ClientError) as error:
        raise LocationError(
            f"these credentials wrote under {location} but cannot delete there "
            f"({first_line(error)}), which replacing an object needs; grant them "
            f"s3:DeleteObject on {location}/* and delete the probe object {probe}"
        ) from None


def unreachable(error: BaseException) -> bool:
    """Whether an object-store request failed in transport (no connection, a timeout, a server
    error) rather than for the object or the credentials: the store may be whole."""
    text = str(error)
    marks = ("NETWORK_CONNECTION", "curlCode", "Connection refused", "timed out", "Timeout")
    return any(mark in text for mark in marks) or "HTTP response code: 5" in text


def denies_access(error: BaseException) -> bool:
    """Whether an S3 request failed for the credentials (refused, unknown or badly signed)
    rather than for the object (missing, malformed)."""
    text = str(error)
    return any(
        mark in text
        for mark in (
            "ACCESS_DENIED",
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "INVALID_ACCESS_KEY_ID",
            "SIGNATURE_DOES_NOT_MATCH",
            "HTTP response code: 403",
        )
    )


def first_line(error: BaseException) -> str:
    """An error's first line (its type's name where it has no text)."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


# ------------------------------------------------------------------------------ operations


def exists(location: Location) -> bool:
    """Whether a file (an object) is at ``location``."""
    if isinstance(location, Path):
        return location.is_file()
    return s3_filesystem().get_file_info(location.path).type == pafs.FileType.File


def first_entries(location: Location, limit: int = 3) -> list[str]:
    """Up to ``limit`` names directly under the folder ``location`` ([] where there is none or
    it is empty); a ``NotADirectoryError`` where a file is there."""
    if isinstance(location, Path):
        if location.exists() and not location.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file, not a directory", str(location))
        return sorted(p.name for p in location.iterdir())[:limit] if location.is_dir() else []
    fs = s3_filesystem()
    if fs.get_file_info(location.path).type == pafs.FileType.File:
        raise NotADirectoryError(errno.ENOTDIR, "an object, not a prefix", str(location))
    selector = pafs.FileSelector(location.path, allow_not_found=True, recursive=False)
    return sorted(PurePosixPath(info.path).name for info in fs.get_file_info(selector))[:limit]


def read_bytes(location: Location) -> bytes:
    """The whole file at ``location``: on S3 its size, then one ranged request for all of it (a
    stream would fetch it in many small requests: 27 MB 11× slower, measured)."""
    if isinstance(location, Path):
        return location.read_bytes()
    with s3_filesystem().open_input_file(location.path) as file:
        return file.read()


def open_input_stream(location: Location) -> BinaryIO:
    """A sequential binary reader of the file at ``location``."""
    if isinstance(location, Path):
        return location.open("rb")
    return s3_filesystem().open_input_stream(location.path)


def open_input_file(location: Location) -> pa.NativeFile:
    """A random-access reader of the file at ``location``: ``read_at`` is one ranged request on
    S3, and safe from several threads at once."""
    if isinstance(location, Path):
        return pa.OSFile(str(location), "rb")
    return s3_filesystem().open_input_file(location.path)


def write_atomic(location: Location, write: Callable[[BinaryIO], None]) -> None:
    """Have ``write`` fill the file at ``location``, which appears whole or not at all: a
    failure (an exception in ``write``, a crash) leaves what was there before.

    Locally a temporary sibling is written, flushed to disk and renamed over it. On S3 an
    object's upload completes whenever its stream closes, an exception included, so the
    content goes to a temporary key first and is then copied server-side to ``location``
    (``copy_object``: one CopyObject, or a multipart copy for a large object, either of which
    replaces the object whole when it completes); the temporary key is deleted either way."""
    if isinstance(location, Path):
        _write_local_atomic(location, write)
        return
    fs = s3_filesystem()
    partial = location.parent / f".{location.name}.{uuid.uuid4().hex}.partial"
    try:
        with fs.open_output_stream(partial.path) as stream:
            write(stream)
        copy_object(partial, location)
    finally:
        _delete_quietly(fs, partial.path)


def copy_object(source: ObjectLocation, target: ObjectLocation) -> None:
    """Copy the object ``source`` to ``target`` inside the store (no byte passes through this
    machine), with boto3's managed copy: one CopyObject up to ``MULTIPART_COPY_THRESHOLD``
    bytes, above it a multipart copy in ``MULTIPART_COPY_CHUNK`` parts (S3 refuses a single
    copy above 5 GiB; a SCAFFOLD checkpoint at scale exceeds that). ``target`` appears only
    when the copy completes; a failed multipart copy is aborted. Failures are ``OSError``, as
    pyarrow's are."""
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import BotoCoreError, ClientError

    transfer = TransferConfig(
        multipart_threshold=MULTIPART_COPY_THRESHOLD, multipart_chunksize=MULTIPART_COPY_CHUNK
    )
    source.check()
    target.check()
    try:
        s3_client(read_timeout=COPY_TIMEOUT_S).copy(
            {"Bucket": source.bucket, "Key": source.key},
            target.bucket,
            target.key,
            Config=transfer,
        )
    except (BotoCoreError, ClientError) as error:
        raise OSError(f"copying {source} to {target} at {endpoint()} failed: {error}") from error


def _write_local_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())  # on disk before it takes the name: a power loss on a
        os.replace(tmp, path)  # shared volume leaves the old file or the new, never empty
        _fsync_directory(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the filesystem lets a directory be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    """Delete ``path`` if it is there; a failure leaves only a stray temporary object."""
    with contextlib.suppress(OSError):
        fs.delete_file(path)


def upload_folder(folder: Path, location: ObjectLocation, last: str | None = None) -> None:
    """Copy every file under the local ``folder`` to the same relative keys under
    ``location``, the file named ``last`` last: a reader who waits for it (a store's manifest
    commits the store) never sees it beside a half-written folder. A ``last`` object already
    there is never deleted nor overwritten: another writer of the same content-keyed folder
    committed it first (its other objects are the same bytes as ours), and runs may be reading
    it; ours is then not committed a second time. The upload stops as soon as ``last``
    appears (checked before each object), so the objects of a committed store are not
    replaced (a store's arrays need not be the same bytes on every machine: PCA's SVD varies
    with the LAPACK build); before a commit, objects left by a writer that died are replaced.
    Left: two writers uploading at once, both before either manifest, can mix their objects
    (S3 has no transaction; ``ShardStore.verify`` recomputes the checksums)."""
    fs = s3_filesystem()
    files = sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file())
    for relative in sorted(files, key=lambda p: p.as_posix() == last):
        if last is not None and exists(location / last):  # committed meanwhile: keep it whole
            return
        pafs.copy_files(
            str(folder / relative),
            (location / relative).path,
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=fs,
        )


def write_folder(location: Location, fill: Callable[[Path], None], last: str | None = None):
    """Have ``fill`` write files into a directory that becomes ``location``: a local one is
    filled in a temporary sibling and renamed into place; an object-store one is filled in a
    local temporary directory and uploaded (``upload_folder``, ``last`` last).

    A folder already at ``location`` that holds ``last`` is kept and ours dropped: a concurrent
    writer of the same folder (two trials of a sweep building one content-keyed store) finished
    first, and runs may be reading it. Locally, a folder in the way that lacks ``last`` is
    replaced only where every entry in it is one ``fill`` wrote too (an earlier copy of this
    folder); one holding anything else is a ``FolderInTheWay``, left as it was."""
    if isinstance(location, ObjectLocation):
        if last is not None and exists(location / last):
            return
        with tempfile.TemporaryDirectory(prefix="dpfl-upload-") as staging:
            fill(Path(staging))
            upload_folder(Path(staging), location, last)
        return
    location.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{location.name}.", dir=location.parent))
    try:
        fill(staging)
        _rename_into_place(staging, location, last)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


class FolderInTheWay(FileExistsError):
    """A directory at a folder's location holds files the folder would not: never deleted."""

    def __init__(self, location: Path, foreign: list[str]):
        self.location, self.foreign = location, foreign
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        super().__init__(
            errno.EEXIST,
            f"a directory that holds other files ({shown}) is in the way: not replaced; "
            "move them or choose another location",
            str(location),
        )

    def __reduce__(self):  # as Ray sends it from an actor: fields, then later state
        return (self.__class__, (self.location, self.foreign), self.__dict__)


def _rename_into_place(staging: Path, location: Path, last: str | None) -> None:
    try:
        os.rename(staging, location)  # atomic; fails where a non-empty folder is in the way
        return
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if last is not None and (location / last).exists():  # another writer's complete folder
        shutil.rmtree(staging)
        return
    ours = {p.name for p in staging.iterdir()}
    foreign = sorted(p.name for p in location.iterdir() if p.name not in ours)
    if foreign:
        raise FolderInTheWay(location, foreign)
    shutil.rmtree(location)  # an earlier copy of this folder, without its last file
    os.replace(staging, location)
