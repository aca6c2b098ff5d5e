"""Errors toolledger raises, each with a stable ``code`` (for logs, the CLI and the API)."""

from __future__ import annotations

from toolledger.domain.submissions import SubmissionFailure


class ToolLedgerError(Exception):
    code = "toolledger_error"


class FencedError(ToolLedgerError):
    """A write carried a lease token that is no longer current: another worker owns the call."""

    code = "fenced"


class TransitionError(ToolLedgerError):
    """The call is not in a state this transition starts from (a lost race, or a bug)."""

    code = "illegal_transition"


class CallNotFoundError(ToolLedgerError):
    code = "call_not_found"


class ArgumentsMismatchError(ToolLedgerError):
    """A redelivered call carries other arguments than the recorded one: refused and flagged."""

    code = "arguments_mismatch"


class RegistryError(ToolLedgerError):
    """A tool cannot be registered as declared."""

    code = "registry_error"


class SubmissionError(ToolLedgerError):
    """The Agents API did not take a request of results, for good or past the retry policy.

    ``kind``: the last try's failure as the gateway classified it by its HTTP status alone
    (``retryable``, ``not_pending``: the SDK-documented registration race, ``session_gone``,
    ``refused``). What became of the calls is never read from it: the session's state
    decides (``runtime.submitter``).

    ``maybe_applied``: some try may have been applied by the API although its answer was
    not a success (a transport error, a timeout, a 5xx). False: every try was answered with
    a refusal (4xx), so the request was not applied.
    """

    code = "submission_failed"

    def __init__(self, message: str, *, kind: SubmissionFailure, maybe_applied: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.maybe_applied = maybe_applied

    @property
    def retryable(self) -> bool:
        return self.kind is SubmissionFailure.RETRYABLE


class SessionGoneError(SubmissionError):
    """The session no longer exists (404): nothing will await its calls."""

    code = "session_gone"

    def __init__(self, message: str, *, maybe_applied: bool = False) -> None:
        super().__init__(message, kind=SubmissionFailure.SESSION_GONE, maybe_applied=maybe_applied)


class TransactionLostError(ToolLedgerError):
    """The database connection broke under a transactional handler: its writes went with the
    transaction. An outage, not the tool's failure: the call is run again once it is taken over."""

    code = "transaction_lost"


class StreamInterruptedError(ToolLedgerError):
    """A session's event stream failed or ended; the follower reconnects after a pause."""

    code = "stream_interrupted"


class AgentsUnavailableError(ToolLedgerError):
    """The Agents API could not be reached or answered 5xx/429: try again later."""

    code = "agents_unavailable"


class AgentsAuthError(ToolLedgerError):
    """The Agents API refused toolledger's credentials (401; or 403 to the start-up check,
    before any session is named): nothing it sends or reads will work until they are fixed,
    so this is fatal, not a dropped stream to retry."""

    code = "agents_auth"


class ConfigurationError(ToolLedgerError):
    """The settings cannot work as given; the message names the variable to set."""

    code = "configuration"


class SchemaNotCurrentError(ToolLedgerError):
    """The ledger database is not at the schema revision this release needs."""

    code = "schema_not_current"
