// The audit web view: lists calls through /api/calls, opens one call's timeline, resolves
// unknown calls. Every value from the ledger is attacker-controlled text (tool arguments,
// outputs): it is only ever put on the page with textContent, never parsed as HTML.

const TOKEN_KEY = "toolledger-token";
const FILTERS = ["session_id", "turn_id", "tool", "status", "effect_class", "since", "until", "q", "sort", "limit"];

const $ = (id) => document.getElementById(id);
let nextCursor = null;
let openCallId = null;

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

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function filterParams() {
  const form = $("filters");
  const params = new URLSearchParams();
  for (const name of FILTERS) {
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

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function shortTime(value) {
  return value ? value.replace("T", " ").replace(/(\.\d{3})\d*/, "$1").replace("+00:00", "Z") : "";
}

function renderRows(calls, append) {
  const body = $("rows");
  if (!append) body.replaceChildren();
  for (const call of calls) {
    const row = document.createElement("tr");
    row.dataset.testid = "call-row";
    row.dataset.callId = call.id;
    row.dataset.status = call.status;
    if (call.needs_operator) row.classList.add("row-unknown");
    if (call.id === openCallId) row.classList.add("selected");
    cell(row, shortTime(call.created_at));
    cell(row, call.session_id);
    cell(row, call.turn_id);
    cell(row, call.call_id);
    cell(row, call.tool_name, "tool");
    cell(row, call.effect_class);
    cell(row, call.status, "status");
    cell(row, call.attempts);
    cell(row, call.submissions);
    row.addEventListener("click", () => openCall(call.id));
    body.appendChild(row);
  }
  $("empty").hidden = body.children.length > 0;
}

async function loadCalls({ append = false } = {}) {
  clearError();
  const params = filterParams();
  if (append && nextCursor) params.set("cursor", nextCursor);
  if (!append) history.replaceState(null, "", `${location.pathname}?${filterParams()}`);
  try {
    const page = await api(`/api/calls?${params}`);
    renderRows(page.calls, append);
    nextCursor = page.next_cursor;
    $("more").hidden = !nextCursor;
  } catch (error) {
    if (!append) {
      $("rows").replaceChildren();
      $("more").hidden = true;
    }
    showError(error);
  }
}

function pretty(value) {
  if (value === null || value === undefined) return "(none)";
  return typeof value === "string" ? value : JSON.stringify(value, null, 2);
}

function renderDetail(detail) {
  const call = detail.call;
  $("detail").hidden = false;
  $("detail-id").textContent = call.id;
  const fields = $("detail-fields");
  fields.replaceChildren();
  const shown = [
    ["session", call.session_id], ["turn", call.turn_id], ["call", call.call_id],
    ["tool", call.tool_name], ["effect class", call.effect_class], ["status", call.status],
    ["attempts", call.attempts], ["submissions", call.submissions],
    ["recorded", shortTime(call.created_at)], ["finished", shortTime(call.finished_at)],
    ["submitted", shortTime(call.submitted_at)], ["confirmed", shortTime(call.confirmed_at)],
    ["error stage", call.error_stage], ["error detail", call.error_detail],
    ["last submission error", call.last_submission_error], ["abandoned", call.abandoned_reason],
    ["lease owner", call.lease_owner],
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
  $("detail-arguments").textContent = pretty(call.arguments);
  $("detail-result").textContent = pretty(call.result);
  const timeline = $("timeline-rows");
  timeline.replaceChildren();
  for (const event of detail.timeline) {
    const row = document.createElement("tr");
    row.dataset.testid = "timeline-row";
    cell(row, shortTime(event.at));
    cell(row, event.actor);
    cell(row, event.kind);
    cell(row, event.from_status);
    cell(row, event.to_status);
    cell(row, [event.reason, event.detail].filter(Boolean).join(" | "));
    timeline.appendChild(row);
  }
  $("resolve").hidden = !call.needs_operator;
  $("resolve-result").textContent = "";
}

async function openCall(id) {
  clearError();
  openCallId = id;
  for (const row of $("rows").children) row.classList.toggle("selected", row.dataset.callId === id);
  try {
    renderDetail(await api(`/api/calls/${encodeURIComponent(id)}`));
  } catch (error) {
    showError(error);
  }
}

async function resolveOpenCall(event) {
  event.preventDefault();
  clearError();
  const form = $("resolve");
  const kind = form.elements.kind.value;
  const body = { kind, reason: form.elements.reason.value.trim() };
  if (kind !== "rerun") body.text = form.elements.text.value;
  const id = openCallId;
  try {
    const answer = await api(`/api/calls/${encodeURIComponent(id)}/resolve`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    form.reset();
    await openCall(id);
    $("resolve-result").textContent = `Resolved: ${answer.action}; the call is now ${answer.call.status}.`;
    await loadCalls();
  } catch (error) {
    showError(error);
  }
}

function init() {
  restoreFilters();
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    $("token").value = "";
    loadCalls();
  });
  $("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    $("rows").replaceChildren();
    $("detail").hidden = true;
  });
  $("filters").addEventListener("submit", (event) => {
    event.preventDefault();
    loadCalls();
  });
  $("more").addEventListener("click", () => loadCalls({ append: true }));
  $("resolve").addEventListener("submit", resolveOpenCall);
  $("resolve").elements.kind.addEventListener("change", (event) => {
    $("resolve").elements.text.disabled = event.target.value === "rerun";
  });
  loadCalls();
}

init();
