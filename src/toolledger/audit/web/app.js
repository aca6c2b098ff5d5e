// The audit web view: lists calls through /api/calls (with their counts from /api/counts),
// opens one call's timeline, resolves unknown calls (one, or all the filters select), approves
// or denies calls awaiting approval, lists sessions (with how they come in: /api/intake). Every value from the ledger is attacker-controlled text (tool
// arguments, outputs): it is only ever put on the page with textContent, never parsed as HTML.
//
// Where the view is lives in the URL: the filters in the query string, the open call or the
// sessions page in the fragment (#call=ID, #sessions), so a link opens the same thing.

const TOKEN_KEY = "toolledger-token";
const OPERATOR_KEY = "toolledger-operator";
const FILTERS = [
  "session_id", "turn_id", "tool", "status", "outcome", "effect_class", "since", "until", "q", "sort", "limit",
];
const COUNT_FILTERS = FILTERS.filter((name) => !["sort", "limit"].includes(name));
const MASK = "[REDACTED]";
// What a decision came to (the API's `action`), told to the person who made it.
const DECISION_OUTCOMES = {
  left_for_service: "`toolledger serve` runs it now, within a poll (this page shows when it is answered)",
  ran: "it ran here and its result was submitted",
  submitted: "the model has been told",
  not_sent: "no Agents API is configured here: `toolledger serve` sends the answer",
  submit_failed: "sending the answer failed for now: `toolledger serve` retries it",
  abandoned: "the session no longer awaits it: abandoned",
};

const $ = (id) => document.getElementById(id);
let pageCursors = [null];
// The cursor of each page shown so far: the previous page is the one before.
let openCallId = null;
let refreshTimer = null;
let loading = false;

class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

async function api(path, options = {}) {
  const headers = { Accept: "application/json", ...(options.headers || {}) };
  if (token()) headers.Authorization = `Bearer ${token()}`;
  let response;
  try {
    response = await fetch(path, { ...options, headers });
  } catch (error) {
    throw new ApiError(0, "the audit API cannot be reached");
  }
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, describe(body, response));
  return body;
}

function describe(body, response) {
  const detail = body && body.detail;
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) return detail.map((item) => item.msg || JSON.stringify(item)).join("; ");
  return `${response.status} ${response.statusText}`;
}

function showError(error) {
  const box = $("error");
  if (error instanceof ApiError && (error.status === 401 || error.status === 403)) {
    box.textContent = `The API refused this request (${error.status}): ${error.message}. ` +
      "Enter a token with the right to do it above.";
    $("token").focus();
  } else {
    box.textContent = error instanceof ApiError ? `The API said: ${error.message}` : String(error);
  }
  box.hidden = false;
}

function showProblem(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

// ------------------------------------------------------------------------ filters, URL

function filterParams(names = FILTERS) {
  const form = $("filters");
  const params = new URLSearchParams();
  for (const name of names) {
    const value = form.elements[name].value.trim();
    if (value !== "") params.set(name, value);
  }
  if (form.elements.unknown_only.checked) params.set("unknown_only", "true");
  return params;
}

function restoreFilters() {
  const form = $("filters");
  const params = new URLSearchParams(location.search);
  for (const name of FILTERS) {
    if (params.has(name)) form.elements[name].value = params.get(name);
  }
  form.elements.unknown_only.checked = params.get("unknown_only") === "true";
}

function fragment() {
  const hash = location.hash.replace(/^#/, "");
  if (hash.startsWith("call=")) return { view: "call", id: decodeURIComponent(hash.slice(5)) };
  if (hash === "sessions") return { view: "sessions" };
  return { view: "calls" };
}

function setFragment(hash) {
  history.replaceState(null, "", `${location.pathname}${location.search}${hash ? `#${hash}` : ""}`);
}

// ------------------------------------------------------------------ times, durations

function shortTime(value) {
  return value ? value.replace("T", " ").replace(/(\.\d{3})\d*/, "$1").replace("+00:00", "Z") : "";
}

function span(seconds) {
  const s = Math.max(0, seconds);
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s < 10 ? s.toFixed(1) : Math.round(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

function ago(value) {
  if (!value) return "";
  const seconds = (Date.now() - Date.parse(value)) / 1000;
  return seconds < 1 ? "just now" : `${span(seconds)} ago`;
}

function between(start, end) {
  return (Date.parse(end) - Date.parse(start)) / 1000;
}

function until(value) {
  const seconds = (Date.parse(value) - Date.now()) / 1000;
  return seconds <= 0 ? "passed" : `in ${span(seconds)}`;
}

// How long a call took (to its result), or how long it has been waiting for one. A call that
// never ran (denied, or not approved in time) waited: it did not "take" anything.
function duration(call) {
  if (call.finished_at && call.error_stage === "approval") {
    return { text: `waited ${span(between(call.created_at, call.finished_at))}` };
  }
  if (call.finished_at) return { text: `took ${span(between(call.started_at || call.created_at, call.finished_at))}` };
  if (["awaiting_approval", "pending", "running", "unknown"].includes(call.status)) {
    return { text: `waiting ${span((Date.now() - Date.parse(call.created_at)) / 1000)}`, waiting: true };
  }
  return { text: "" };
}

function outcomeText(call) {
  if (!call.outcome) return "";
  return call.outcome === "failed" && call.error_stage ? `failed: ${call.error_stage}` : call.outcome;
}

// ---------------------------------------------------------------------------- calls

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function renderRows(calls) {
  const body = $("rows");
  body.replaceChildren();
  for (const call of calls) {
    const row = document.createElement("tr");
    row.dataset.testid = "call-row";
    row.dataset.callId = call.id;
    row.dataset.status = call.status;
    if (call.needs_operator) row.classList.add("row-unknown");
    if (call.needs_approval) row.classList.add("row-approval");
    if (call.id === openCallId) row.classList.add("selected");
    cell(row, ago(call.created_at), "time").title = shortTime(call.created_at);
    const id = cell(row, call.id.slice(0, 15), "id");
    id.title = call.id;
    cell(row, call.session_id, "id session");
    cell(row, call.call_id, "id call");
    cell(row, call.tool_name, "tool");
    cell(row, call.effect_class, "wide-only");
    cell(row, call.status, "status");
    cell(row, outcomeText(call), `outcome outcome-${call.outcome || "none"}`);
    const took = duration(call);
    cell(row, took.text, took.waiting ? "duration waiting" : "duration");
    cell(row, call.attempts, "wide-only number");
    row.addEventListener("click", () => openCall(call.id));
    body.appendChild(row);
  }
  $("empty").hidden = body.children.length > 0;
}

function renderCounts(counts) {
  const box = $("counts");
  box.replaceChildren();
  const total = document.createElement("strong");
  total.textContent = `${counts.total} call(s)`;
  box.appendChild(total);
  const groups = [
    [
      "status",
      counts.by_status,
      ["awaiting_approval", "pending", "running", "unknown", "succeeded", "failed", "submitted", "abandoned"],
    ],
    ["outcome", counts.by_outcome, ["succeeded", "failed", "none"]],
  ];
  for (const [filter, tally, order] of groups) {
    const group = document.createElement("span");
    group.className = "count-group";
    group.textContent = `${filter}:`;
    for (const name of order) {
      if (!tally[name]) continue;
      const button = document.createElement("button");
      button.type = "button";
      button.className = `count count-${name}`;
      button.dataset.testid = `count-${filter}-${name}`;
      button.textContent = `${name} ${tally[name]}`;
      if (name !== "none") {
        button.title = `show only ${filter} ${name}`;
        button.addEventListener("click", () => {
          $("filters").elements[filter].value = name;
          loadCalls();
        });
      } else {
        button.disabled = true;
      }
      group.appendChild(button);
    }
    box.appendChild(group);
  }
}

let latestLoad = 0;

async function loadCalls({ page = 0, quiet = false } = {}) {
  // Only the latest request is shown: a refresh answered after a click on "Next page" must
  // not put the page before back.
  const load = ++latestLoad;
  if (!quiet) clearError();
  if (page === 0) pageCursors = [null];
  const params = filterParams();
  const cursor = pageCursors[page];
  if (cursor) params.set("cursor", cursor);
  history.replaceState(null, "", `${location.pathname}?${filterParams()}${location.hash}`);
  try {
    const [listing, counts] = await Promise.all([
      api(`/api/calls?${params}`),
      api(`/api/counts?${filterParams(COUNT_FILTERS)}`),
    ]);
    if (load !== latestLoad) return;
    renderRows(listing.calls);
    renderCounts(counts);
    pageCursors = pageCursors.slice(0, page + 1);
    if (listing.next_cursor) pageCursors.push(listing.next_cursor);
    $("more").hidden = !listing.next_cursor;
    $("more").dataset.page = String(page + 1);
    $("previous").hidden = page === 0;
    $("previous").dataset.page = String(page - 1);
    $("page-number").textContent = page > 0 || listing.next_cursor ? `page ${page + 1}` : "";
    currentPage = page;
    markRefreshed();
  } catch (error) {
    if (load !== latestLoad) return;
    if (!quiet) {
      $("rows").replaceChildren();
      $("counts").replaceChildren();
      $("more").hidden = true;
      $("previous").hidden = true;
    }
    showError(error);
  }
}

let currentPage = 0;

function markRefreshed() {
  $("refreshed").textContent = `updated ${new Date().toISOString().slice(11, 19)} UTC`;
}

function pretty(value) {
  if (value === null || value === undefined) return "(none)";
  return typeof value === "string" ? value : JSON.stringify(value, null, 2);
}

// A lease names the worker running the call: once the call is no longer running, or the
// lease has run out, that worker holds nothing (it may be long dead).
function leaseText(call) {
  if (!call.lease_owner || call.status !== "running") return null;
  if (call.lease_expires_at && Date.parse(call.lease_expires_at) <= Date.now()) {
    return `expired ${ago(call.lease_expires_at)} (was ${call.lease_owner})`;
  }
  return `${call.lease_owner}, for ${span(between(new Date().toISOString(), call.lease_expires_at))} more`;
}

function timed(value) {
  return value ? `${shortTime(value)} (${ago(value)})` : null;
}

function renderDetail(detail, { keepForm = false } = {}) {
  const call = detail.call;
  $("detail").hidden = false;
  $("detail-id").textContent = call.id;
  $("detail-link").href = `${location.pathname}${location.search}#call=${encodeURIComponent(call.id)}`;
  const fields = $("detail-fields");
  fields.replaceChildren();
  const took = duration(call);
  const shown = [
    ["session", call.session_id], ["turn", call.turn_id], ["call", call.call_id],
    ["tool", call.tool_name], ["effect class", call.effect_class], ["status", call.status],
    ["outcome", outcomeText(call)],
    ["attempts", call.attempts], ["submissions", call.submissions],
    ["recorded", timed(call.created_at)], ["finished", timed(call.finished_at)],
    ["duration", took.text],
    ["submitted", timed(call.submitted_at)], ["confirmed", timed(call.confirmed_at)],
    ["error stage", call.error_stage], ["error detail", call.error_detail],
    ["last submission error", call.last_submission_error], ["abandoned", call.abandoned_reason],
    ["lease owner", leaseText(call)],
    ["approval decided by", call.approval_decided_by], ["approval decided", timed(call.approval_decided_at)],
  ];
  for (const [name, value] of shown) {
    if (value === null || value === undefined || value === "") continue;
    const dt = document.createElement("dt");
    dt.textContent = name;
    const dd = document.createElement("dd");
    dd.textContent = String(value);
    dd.dataset.testid = `field-${name.replaceAll(" ", "_")}`;
    fields.append(dt, dd);
  }
  // What the ledger holds of the call is not what its trail recorded: said above everything.
  const trail = detail.trail;
  let broken = null;
  if (!trail.intact) broken = `${trail.message}.`;
  else if (trail.keyed === false) broken = `keyed check failed: ${trail.keyed_message}.`;
  $("detail-trail").hidden = broken === null;
  $("detail-trail").textContent = broken === null ? "" : `Trail BROKEN: ${broken} What is shown here `
    + "is NOT what the call's trail recorded (toolledger calls verify-trail names every break).";
  $("detail-arguments").textContent = pretty(call.arguments);
  $("detail-result").textContent = pretty(call.result);
  $("approved-box").hidden = call.approved_arguments === null || call.approved_arguments === undefined;
  $("detail-approved-arguments").textContent = pretty(call.approved_arguments);
  const timeline = $("timeline-rows");
  timeline.replaceChildren();
  for (const event of detail.timeline) {
    const row = document.createElement("tr");
    row.dataset.testid = "timeline-row";
    cell(row, shortTime(event.at).slice(11), "time").title = shortTime(event.at);
    cell(row, event.actor);
    cell(row, event.kind);
    cell(row, event.from_status);
    cell(row, event.to_status);
    cell(row, [event.reason, event.detail].filter(Boolean).join(" | "), "reason");
    timeline.appendChild(row);
  }
  $("resolve").hidden = !call.needs_operator;
  renderApproval(call);
  if (!keepForm) {
    $("resolve-result").textContent = "";
    $("approval-result").textContent = "";
  }
}

function deadlineText(call) {
  if (!call.approval_expires_at) return "none: it waits until someone decides";
  const when = until(call.approval_expires_at);
  const answer = "the model is told it was not approved in time";
  return `${shortTime(call.approval_expires_at)} (${when}): then ${answer}`;
}

// The form keeps the fingerprint of the arguments shown with it: a decision names exactly
// those, so a page left open while something changed cannot approve arguments nobody saw.
function renderApproval(call) {
  const form = $("approval");
  form.hidden = !call.needs_approval;
  form.dataset.sha256 = call.arguments_sha256;
  // The arguments themselves, in the box, before the buttons: what is approved is read there.
  $("approval-shown-arguments").textContent = call.needs_approval ? pretty(call.arguments) : "";
  $("approval-sha256").textContent = call.arguments_sha256;
  $("approval-deadline").textContent = call.needs_approval ? deadlineText(call) : "";
}

async function openCall(id, { quiet = false } = {}) {
  if (!quiet) clearError();
  const changed = id !== openCallId;
  openCallId = id;
  setFragment(`call=${encodeURIComponent(id)}`);
  for (const row of $("rows").children) row.classList.toggle("selected", row.dataset.callId === id);
  try {
    renderDetail(await api(`/api/calls/${encodeURIComponent(id)}`), { keepForm: quiet });
    if (changed && !quiet) $("detail").scrollIntoView({ block: "nearest" });
  } catch (error) {
    showError(error);
  }
}

function closeCall() {
  openCallId = null;
  $("detail").hidden = true;
  setFragment("");
  for (const row of $("rows").children) row.classList.remove("selected");
}

async function resolveOpenCall(event) {
  event.preventDefault();
  clearError();
  const form = $("resolve");
  const kind = form.elements.kind.value;
  const body = { kind, reason: form.elements.reason.value.trim() };
  if (kind !== "rerun") body.text = form.elements.text.value;
  const operator = form.elements.operator.value.trim();
  // The name typed counts only without a token: with one, the token's name is the operator.
  if (operator && !token()) {
    body.operator = operator;
    sessionStorage.setItem(OPERATOR_KEY, operator);
  }
  const id = openCallId;
  try {
    const answer = await api(`/api/calls/${encodeURIComponent(id)}/resolve`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    form.reset();
    form.elements.operator.value = sessionStorage.getItem(OPERATOR_KEY) || "";
    await openCall(id);
    $("resolve-result").textContent = answer.action === "rerunning"
      ? "Re-opened: it runs again in the background. Open the call again to follow it to its end."
      : `Resolved: ${answer.action}; the call is now ${answer.call.status}.`;
    await loadCalls({ page: currentPage });
  } catch (error) {
    showError(error);
  }
}

// Amended arguments as typed: nothing (run as the model asked), or a JSON object. What the
// page shows of the arguments is masked; a mask copied back would reach the handler as text.
function amendedArguments(text) {
  if (text.trim() === "") return { value: null };
  let value;
  try {
    value = JSON.parse(text);
  } catch (error) {
    return { problem: `The amended arguments are not JSON (${error.message}): nothing was sent.` };
  }
  if (value === null || typeof value !== "object" || Array.isArray(value)) {
    return { problem: 'The amended arguments must be a JSON object, {"name": value, ...}: nothing was sent.' };
  }
  if (holdsMask(value)) {
    return {
      problem: `The amended arguments hold ${MASK}, a masked value the page showed: type the real ` +
        "value, or leave the arguments empty to run the call as the model asked. Nothing was sent.",
    };
  }
  return { value };
}

// As the API refuses it: the mask anywhere, a key or a text, alone or within a longer text.
function holdsMask(value) {
  if (typeof value === "string") return value.includes(MASK);
  if (value === null || typeof value !== "object") return false;
  return Object.entries(value).some(([key, item]) => key.includes(MASK) || holdsMask(item));
}

async function decideOpenCall(verb) {
  const form = $("approval");
  if (!form.reportValidity()) return;
  clearError();
  const body = { reason: form.elements.reason.value.trim(), arguments_sha256: form.dataset.sha256 };
  const amended = form.elements.arguments.value;
  if (verb === "approve") {
    const parsed = amendedArguments(amended);
    if (parsed.problem) {
      showProblem(parsed.problem);
      form.elements.arguments.focus();
      return;
    }
    if (parsed.value !== null) body.arguments = parsed.value;
  } else if (amended.trim() !== "") {
    showProblem("A denial takes no arguments: empty the amended arguments, or approve. Nothing was sent.");
    return;
  }
  const operator = form.elements.operator.value.trim();
  // As for a resolution: the name typed counts only without a token.
  if (operator && !token()) {
    body.operator = operator;
    sessionStorage.setItem(OPERATOR_KEY, operator);
  }
  const id = openCallId;
  const buttons = [$("approval-approve"), $("approval-deny")];
  // One decision at a time: a second click would only be refused (409).
  for (const button of buttons) button.disabled = true;
  try {
    const answer = await api(`/api/calls/${encodeURIComponent(id)}/${verb}`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    form.reset();
    form.elements.operator.value = sessionStorage.getItem(OPERATOR_KEY) || "";
    await openCall(id);
    const outcome = DECISION_OUTCOMES[answer.action] || answer.action;
    $("approval-result").textContent =
      `${verb === "approve" ? "Approved" : "Denied"}: ${outcome}; the call is now ${answer.call.status}.`;
    await loadCalls({ page: currentPage });
  } catch (error) {
    // Refused as decided already or as other arguments: the call is read again, so what the
    // person looks at next (and decides on) is what the ledger holds now.
    if (error instanceof ApiError && error.status === 409) await openCall(id, { quiet: true });
    showError(error);
  } finally {
    for (const button of buttons) button.disabled = false;
  }
}

// ------------------------------------------------------------ bulk resolution

// What each of a bulk resolution's actions means, shown beside its count.
const BULK_ACTIONS = {
  would_resolve: "would be resolved as you say",
  would_ask_verify_hook: "verified: its hook would be asked first, and what it finds wins",
  would_skip_verify_hook_unavailable: "verified: would be skipped (the API cannot ask its hook)",
  submitted: "resolved, and the model has been told",
  not_sent: "resolved; no Agents API is configured here: `toolledger serve` sends the answer",
  left_for_service: "re-opened: `toolledger serve` runs them again",
  rerun: "ran again here and submitted",
  submit_failed: "resolved; sending the answer failed for now: `toolledger serve` retries it",
  abandoned: "resolved; the session no longer awaits them",
  settled_by_verify_hook: "its verify hook found it happened: its true outcome was submitted",
  skipped_verify_hook_unavailable: "verified: skipped, the API cannot ask its hook",
  skipped_hook_says_not_executed: "skipped: its verify hook says it did not happen",
  skipped_no_longer_unknown: "skipped: settled by someone else meanwhile",
};
const BULK_LISTED = 100;
// The dry run that was shown: confirming resolves exactly that request, with no more calls
// than it counted; anything changed since (the filters, the resolution) needs a new dry run.
let bulkPlan = null;

function bulkRequest() {
  const form = $("bulk-form");
  const kind = form.elements.kind.value;
  const rate = form.elements.rate.value.trim();
  const body = { kind, reason: form.elements.reason.value.trim(), rate: rate === "" ? 5 : Number(rate) };
  if (kind !== "rerun") body.text = form.elements.text.value;
  const operator = form.elements.operator.value.trim();
  // As for one resolution: the name typed counts only without a token.
  if (operator && !token()) body.operator = operator;
  return { params: filterParams(COUNT_FILTERS).toString(), body };
}

function forgetBulkPlan() {
  bulkPlan = null;
  $("bulk-confirm").hidden = true;
}

async function postBulk(request, extra) {
  return api(`/api/bulk/resolve?${request.params}`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ ...request.body, ...extra }),
  });
}

function renderBulkSummary(answer, headline) {
  const box = $("bulk-summary");
  box.replaceChildren();
  const head = document.createElement("p");
  head.dataset.testid = "bulk-headline";
  head.textContent = headline;
  box.appendChild(head);
  const counts = document.createElement("ul");
  counts.dataset.testid = "bulk-counts";
  for (const [action, number] of Object.entries(answer.counts).sort()) {
    const item = document.createElement("li");
    item.dataset.testid = `bulk-count-${action}`;
    const meaning = BULK_ACTIONS[action];
    item.textContent = `${action}: ${number}${meaning ? ` (${meaning})` : ""}`;
    counts.appendChild(item);
  }
  box.appendChild(counts);
  if (answer.calls.length === 0) return;
  const table = document.createElement("table");
  table.className = "calls";
  const header = document.createElement("tr");
  for (const name of ["Session", "Call", "Tool", "Action", "Note"]) {
    const th = document.createElement("th");
    th.textContent = name;
    header.appendChild(th);
  }
  table.createTHead().appendChild(header);
  const body = document.createElement("tbody");
  body.dataset.testid = "bulk-calls";
  for (const item of answer.calls.slice(0, BULK_LISTED)) {
    const row = document.createElement("tr");
    row.dataset.callId = item.call.id;
    cell(row, item.call.session_id, "id");
    cell(row, item.call.call_id, "id");
    cell(row, item.call.tool_name);
    cell(row, item.action);
    cell(row, item.note, "reason");
    body.appendChild(row);
  }
  table.appendChild(body);
  box.appendChild(table);
  if (answer.calls.length > BULK_LISTED) {
    const more = document.createElement("p");
    more.className = "muted";
    more.textContent = `and ${answer.calls.length - BULK_LISTED} more`;
    box.appendChild(more);
  }
}

async function bulkDryRun(event) {
  event.preventDefault();
  clearError();
  forgetBulkPlan();
  $("bulk-summary").replaceChildren();
  const request = bulkRequest();
  if (request.body.operator) sessionStorage.setItem(OPERATOR_KEY, request.body.operator);
  try {
    const answer = await postBulk(request, { dry_run: true });
    const time = answer.matched ? `; about ${span(answer.estimated_seconds)} at ${request.body.rate} per second` : "";
    renderBulkSummary(
      answer,
      `Dry run: ${answer.matched} unknown call(s) match these filters${time}. Nothing has changed.`,
    );
    if (answer.matched > 0) {
      bulkPlan = { ...request, matched: answer.matched };
      const confirm = $("bulk-confirm");
      confirm.textContent = `Resolve these ${answer.matched} call(s) by ${request.body.kind}`;
      confirm.hidden = false;
    }
  } catch (error) {
    showError(error);
  }
}

async function bulkConfirm() {
  clearError();
  const request = bulkRequest();
  const plan = bulkPlan;
  if (!plan || request.params !== plan.params || JSON.stringify(request.body) !== JSON.stringify(plan.body)) {
    forgetBulkPlan();
    showProblem("The filters or the resolution changed since the dry run: run the dry run again. Nothing was resolved.");
    return;
  }
  const buttons = [$("bulk-confirm"), document.querySelector("[data-testid=bulk-dry-run]")];
  for (const button of buttons) button.disabled = true;
  const head = document.createElement("p");
  head.textContent = `Resolving ${plan.matched} call(s) at ${plan.body.rate} per second ` +
    `(about ${span(plan.matched / plan.body.rate)}): keep this page open.`;
  $("bulk-summary").replaceChildren(head);
  try {
    // max_calls: calls recorded since the dry run are not resolved unseen (the API says 409).
    const answer = await postBulk(request, { dry_run: false, max_calls: plan.matched });
    forgetBulkPlan();
    // The API keeps its time cap by the clock: a run that ran out of time says what it left.
    const headline = answer.stopped_early
      ? `Stopped at the time limit (bulk ${answer.run_id}): ${answer.done} of ${answer.matched} call(s) ` +
        `gone through, ${answer.left} left untouched. Run the dry run again to resolve the rest.`
      : `Done (bulk ${answer.run_id}): ${answer.matched} call(s) matched.`;
    renderBulkSummary(answer, headline);
    await loadCalls({ page: currentPage });
  } catch (error) {
    forgetBulkPlan();
    $("bulk-summary").replaceChildren();
    showError(error);
  } finally {
    for (const button of buttons) button.disabled = false;
  }
}

// ------------------------------------------------------------------------- sessions

function leaseOf(session) {
  if (!session.owner) return "";
  if (session.lease_expires_at && Date.parse(session.lease_expires_at) <= Date.now()) return "";
  return session.owner;
}

// A sweep's watermark (Unix seconds) as `toolledger status` shows it.
function utcSeconds(seconds) {
  if (seconds === null || seconds === undefined) return "none";
  return new Date(seconds * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
}

function fact(list, term, text, testid) {
  const dt = document.createElement("dt");
  dt.textContent = term;
  const dd = document.createElement("dd");
  dd.textContent = text;
  dd.dataset.testid = testid;
  list.append(dt, dd);
  return dd;
}

// The webhook counts of the live replicas: accepted and duplicate first, then the rest
// (ignored, unavailable), then the refusals by reason.
function webhookText(counts, taken) {
  const outcomes = {};
  const refused = [];
  for (const [name, n] of Object.entries(counts).sort()) {
    if (!name.startsWith("webhook_")) continue;
    const outcome = name.slice("webhook_".length);
    if (outcome.startsWith("refused_")) refused.push(`${outcome.slice("refused_".length)} ${n}`);
    else outcomes[outcome] = n;
  }
  const parts = [`accepted ${outcomes.accepted || 0}`, `duplicate ${outcomes.duplicate || 0}`];
  for (const [outcome, n] of Object.entries(outcomes)) {
    if (!["accepted", "duplicate"].includes(outcome)) parts.push(`${outcome} ${n}`);
  }
  parts.push(refused.length ? `refused: ${refused.join(", ")}` : "refused 0");
  return `${parts.join(", ")} (live replicas, since each started); ${taken} id(s) kept`;
}

// Whole seconds under a minute (a sweep runs every few minutes: no milliseconds), then as
// other ages are shown.
function sweepAge(seconds) {
  if (seconds === null || seconds === undefined) return "never";
  return seconds < 60 ? `${Math.round(seconds)} s ago` : `${span(seconds)} ago`;
}

function renderIntake(intake) {
  const facts = $("intake-facts");
  facts.replaceChildren();
  fact(facts, "Modes", intake.modes.join(" + "), "intake-modes");
  fact(facts, "Agents", intake.agent_ids.length ? intake.agent_ids.join(", ") : "none", "intake-agents");
  fact(
    facts,
    "Looks",
    `${intake.looks_due} due; ${intake.intake_sessions} session(s) came by webhook or sweep`,
    "intake-looks",
  );
  const hasWebhooks = intake.modes.includes("webhooks") || intake.webhooks_taken > 0 ||
    Object.keys(intake.counts).some((name) => name.startsWith("webhook_"));
  if (hasWebhooks) fact(facts, "Webhooks", webhookText(intake.counts, intake.webhooks_taken), "intake-webhooks");
  const sweeps = $("intake-sweeps");
  sweeps.replaceChildren();
  for (const sweep of intake.sweeps) {
    const item = document.createElement("li");
    item.dataset.testid = "intake-sweep";
    item.dataset.agentId = sweep.agent_id;
    item.textContent = `sweep ${sweep.agent_id}: last run ${sweepAge(sweep.last_run_age_seconds)}, ` +
      `found ${sweep.last_found || 0}, watermark ${utcSeconds(sweep.watermark)}, ${sweep.runs} run(s)`;
    if (sweep.last_error) {
      const error = document.createElement("span");
      error.className = "sweep-error";
      error.dataset.testid = "intake-sweep-error";
      error.textContent = `; last error: ${sweep.last_error}`;
      item.appendChild(error);
    }
    sweeps.appendChild(item);
  }
  $("intake").hidden = false;
}

async function loadSessions({ quiet = false } = {}) {
  if (!quiet) clearError();
  try {
    const [sessions, intake] = await Promise.all([api("/api/sessions?limit=500"), api("/api/intake")]);
    renderIntake(intake);
    const body = $("session-rows");
    body.replaceChildren();
    for (const session of sessions) {
      const row = document.createElement("tr");
      row.dataset.testid = "session-row";
      row.dataset.sessionId = session.session_id;
      // The id is a link to the session's calls (the whole row opens them too).
      const link = document.createElement("a");
      link.href = "#calls";
      link.textContent = session.session_id;
      link.title = "this session's calls";
      link.dataset.testid = "session-link";
      cell(row, "", "id").appendChild(link);
      cell(row, session.watched === null ? "never" : session.watched ? "yes" : "no");
      cell(row, session.status);
      cell(row, leaseOf(session), "id");
      cell(row, ago(session.last_polled_at), "time").title = shortTime(session.last_polled_at);
      const calls = cell(row, Object.entries(session.calls).map(([status, n]) => `${status} ${n}`).join(", "));
      // Calls a person must act on (settle an unknown one, approve or deny one): marked.
      const waiting = (session.calls.unknown || 0) + (session.calls.awaiting_approval || 0);
      if (waiting) {
        row.classList.add("needs-person");
        const mark = document.createElement("span");
        mark.className = "needs-person";
        mark.dataset.testid = "needs-person";
        mark.textContent = `${waiting} need${waiting === 1 ? "s" : ""} a person: `;
        calls.prepend(mark);
      }
      // Registered sessions are watched; the others came by a webhook or the sweep (and are
      // looked at when asked, with no stream to follow). Never watched and neither: unknown.
      const cameBy = session.intake || (session.watched === null ? "" : "watched");
      const came = cell(row, cameBy, "came-by");
      came.dataset.testid = "came-by";
      came.dataset.cameBy = cameBy;
      if (session.looking) {
        const looking = document.createElement("span");
        looking.className = "looking";
        looking.dataset.testid = "looking";
        looking.textContent = " (looking now)";
        came.appendChild(looking);
      }
      cell(row, session.agent_id, "id agent").dataset.testid = "agent-id";
      cell(row, session.reason, "reason");
      const open = (event) => {
        event.preventDefault();
        const form = $("filters");
        for (const name of FILTERS) if (!["sort", "limit"].includes(name)) form.elements[name].value = "";
        form.elements.unknown_only.checked = false;
        form.elements.session_id.value = session.session_id;
        location.hash = "calls";
      };
      row.addEventListener("click", open);
      body.appendChild(row);
    }
    $("sessions-empty").hidden = sessions.length > 0;
    markRefreshed();
  } catch (error) {
    showError(error);
  }
}

// --------------------------------------------------------------------- navigation

function route() {
  const where = fragment();
  const sessions = where.view === "sessions";
  $("calls-page").hidden = sessions;
  $("sessions-page").hidden = !sessions;
  $("nav-calls").classList.toggle("current", !sessions);
  $("nav-sessions").classList.toggle("current", sessions);
  if (sessions) {
    loadSessions();
    return;
  }
  loadCalls();
  if (where.view === "call") openCall(where.id);
  else if (openCallId) closeCall();
}

async function refresh() {
  if (loading || document.hidden) return;
  loading = true;
  try {
    if (fragment().view === "sessions") {
      await loadSessions({ quiet: true });
    } else {
      await loadCalls({ page: currentPage, quiet: true });
      // The open call is read again too, but an operator's half-typed resolution is kept.
      if (openCallId) await openCall(openCallId, { quiet: true });
    }
  } finally {
    loading = false;
  }
}

function scheduleRefresh() {
  clearInterval(refreshTimer);
  refreshTimer = null;
  if ($("auto-refresh").checked) {
    refreshTimer = setInterval(refresh, Number($("refresh-every").value) * 1000);
  }
}

// With a token, its name is the operator: the name fields are for a token-less API only.
function showOperatorFields() {
  for (const label of document.querySelectorAll(".operator-label")) label.hidden = Boolean(token());
}

function init() {
  restoreFilters();
  for (const form of [$("resolve"), $("approval"), $("bulk-form")]) {
    form.elements.operator.value = sessionStorage.getItem(OPERATOR_KEY) || "";
  }
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    $("token").value = "";
    showOperatorFields();
    route();
  });
  $("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showOperatorFields();
    $("rows").replaceChildren();
    $("counts").replaceChildren();
    $("detail").hidden = true;
    $("session-rows").replaceChildren();
    $("intake").hidden = true;
  });
  showOperatorFields();
  $("filters").addEventListener("submit", (event) => {
    event.preventDefault();
    loadCalls();
  });
  $("more").addEventListener("click", () => loadCalls({ page: Number($("more").dataset.page) }));
  $("previous").addEventListener("click", () => loadCalls({ page: Number($("previous").dataset.page) }));
  $("detail-close").addEventListener("click", closeCall);
  $("resolve").addEventListener("submit", resolveOpenCall);
  // Each decision is a button of its own; Enter in a field decides nothing (it would approve).
  $("approval").addEventListener("submit", (event) => event.preventDefault());
  $("approval-approve").addEventListener("click", () => decideOpenCall("approve"));
  $("approval-deny").addEventListener("click", () => decideOpenCall("deny"));
  $("resolve").elements.kind.addEventListener("change", (event) => {
    $("resolve").elements.text.disabled = event.target.value === "rerun";
  });
  $("bulk-form").addEventListener("submit", bulkDryRun);
  $("bulk-confirm").addEventListener("click", bulkConfirm);
  // A changed filter or resolution is not what the dry run showed.
  for (const form of [$("bulk-form"), $("filters")]) form.addEventListener("input", forgetBulkPlan);
  $("bulk-form").elements.kind.addEventListener("change", (event) => {
    $("bulk-form").elements.text.disabled = event.target.value === "rerun";
  });
  $("auto-refresh").addEventListener("change", scheduleRefresh);
  $("refresh-every").addEventListener("change", scheduleRefresh);
  window.addEventListener("hashchange", route);
  route();
  scheduleRefresh();
}

init();
