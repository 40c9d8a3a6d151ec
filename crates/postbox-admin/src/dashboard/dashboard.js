// postbox dashboard: polls /api/stats and the failed list every few seconds
// (`postbox serve`), and the consumers (`postbox consume`), whose dead
// letters are read from the broker when asked (never polled); each part
// shows when its process serves its API. Plain JS, no
// dependencies; served from the postbox binary.
"use strict";

const REFRESH_MS = 3000;
const TOKEN_KEY = "postbox-admin-token";
const STATUSES = ["pending", "delivering", "delivered", "retryable", "failed"];

const $ = (sel) => document.querySelector(sel);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : String(c ?? ""));
  return e;
}

function age(seconds) {
  if (!seconds) return "—";
  if (seconds < 120) return seconds.toFixed(1) + " s";
  if (seconds < 7200) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function time(ms) {
  return new Date(ms).toLocaleString();
}

// Every API call carries the token of this tab (sessionStorage, sent as a
// header: no cookie, so no other site can make the browser call for it).
// A read answered 401 asks for the token once and tries again; a refused
// prompt is not asked again until the page is reloaded.
let tokenRefused = false;

async function getJson(url, init, retried) {
  const t = sessionStorage.getItem(TOKEN_KEY);
  const headers = Object.assign({}, (init && init.headers) || {});
  if (t && !headers.Authorization) headers.Authorization = "Bearer " + t;
  const res = await fetch(url, Object.assign({}, init, { headers }));
  let body = null;
  try { body = await res.json(); } catch (_) { /* not JSON */ }
  const reading = !init || !init.method || init.method === "GET";
  if (res.status === 401 && reading && !retried && !tokenRefused) {
    if (token(true, "Admin token (viewer or operator) to read events:")) return getJson(url, init, true);
    tokenRefused = true;
  }
  if (!res.ok) {
    const err = new Error((body && body.error) || res.status + " " + res.statusText);
    err.status = res.status;
    throw err;
  }
  return body;
}

let appCodes = [];

function renderStats(snap) {
  appCodes = snap.apps.map((a) => a.app_code);
  const pick = $("#search select[name=app_code]");
  if (pick.options.length !== appCodes.length + 1) {
    pick.replaceChildren(el("option", { value: "" }, "any app_code"), ...appCodes.map((a) => el("option", { value: a }, a)));
  }
  const body = $("#apps tbody");
  body.replaceChildren(...snap.apps.map((a) => {
    const cells = STATUSES.map((s) => el("td", {
      class: "num" + (a[s] > 0 ? " nonzero" : ""), "data-status": s,
    }, a[s]));
    return el("tr", { "data-app": a.app_code }, el("td", {}, a.app_code), ...cells,
      el("td", { class: "num", "data-age": "" }, age(a.oldest_pending_age_seconds)));
  }));
  renderChart(snap);
  const upd = $("#updated");
  if (snap.error) {
    upd.textContent = "database unreachable: " + snap.error;
    upd.classList.add("stale");
  } else {
    upd.textContent = "updated " + time(snap.taken_at_ms || Date.now());
    upd.classList.remove("stale");
  }
}

function renderChart(snap) {
  const svg = $("#chart");
  const now = snap.taken_at_ms || Date.now();
  const first = Math.floor((now - 3600000) / 60000) * 60000;
  const perMinute = new Map();
  for (const counts of Object.values(snap.delivered_per_minute || {})) {
    for (const c of counts) perMinute.set(c.minute_ms, (perMinute.get(c.minute_ms) || 0) + c.delivered);
  }
  const bars = [];
  for (let i = 0; i <= 60; i++) bars.push(perMinute.get(first + i * 60000) || 0);
  const max = Math.max(1, ...bars);
  const w = 600 / bars.length;
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren(...bars.map((n, i) => {
    const r = document.createElementNS(ns, "rect");
    const h = (n / max) * 136;
    r.setAttribute("x", (i * w + 0.5).toFixed(1));
    r.setAttribute("width", Math.max(1, w - 1).toFixed(1));
    r.setAttribute("y", (140 - h).toFixed(1));
    r.setAttribute("height", h.toFixed(1));
    const t = document.createElementNS(ns, "title");
    t.textContent = new Date(first + i * 60000).toLocaleTimeString() + ": " + n + " delivered";
    r.append(t);
    return r;
  }));
  $("#chart-max").textContent = "max " + max + "/min";
}

async function loadFailed() {
  const pages = await Promise.all(appCodes.map((a) =>
    getJson("/api/events?status=failed&limit=50&app_code=" + encodeURIComponent(a))));
  const rows = pages.flatMap((p) => p.items).sort((a, b) => b.id - a.id);
  $("#failed-empty").hidden = rows.length > 0;
  $("#failed tbody").replaceChildren(...rows.map((r) => el("tr", {
    "data-event-id": r.event_id, "data-app": r.app_code, onclick: () => showTimeline(r.event_id),
  },
  el("td", { class: "num" }, r.id), el("td", {}, r.app_code), el("td", {}, el("code", {}, r.event_id)),
  el("td", {}, r.event_type), el("td", { class: "num" }, r.retry_count),
  el("td", { class: "error" }, r.last_error || ""), el("td", {}, time(r.updated_at_ms)),
  el("td", {}, targetPicker(), " ", el("button", {
    class: "replay", type: "button",
    onclick: (ev) => {
      ev.stopPropagation();
      replay(r, ev.target, false, ev.target.parentElement.querySelector("select.replay-to").value);
    },
  }, "Replay")))));
}

let publishers = null;

async function loadPublishers() {
  if (publishers === null) publishers = (await getJson("/api/publishers")).publishers || [];
}

// Replay targets: by default the publishers that have not confirmed the
// event; or every publisher; or one.
function targetPicker() {
  return el("select", { class: "replay-to", "aria-label": "replay to", onclick: (ev) => ev.stopPropagation() },
    el("option", { value: "" }, "to unconfirmed publishers"),
    el("option", { value: "*" }, "to all publishers"),
    ...(publishers || []).map((p) => el("option", { value: p }, "only to " + p)));
}

function token(forceAsk, question) {
  let t = sessionStorage.getItem(TOKEN_KEY);
  if (!t || forceAsk) {
    t = window.prompt(question || "Admin token (an operator's) for replays:");
    if (!t) return null;
    sessionStorage.setItem(TOKEN_KEY, t);
  }
  return t;
}

function say(text, ok) {
  const m = $("#replay-message");
  m.textContent = text;
  m.className = ok ? "ok" : "error";
}

async function replay(row, button, retried, to) {
  const t = token(retried);
  if (!t) return say("Replay cancelled: no token given.", false);
  button.disabled = true;
  try {
    let url = "/api/events/" + encodeURIComponent(row.event_id) + "/replay?app_code=" + encodeURIComponent(row.app_code);
    if (to === "*") url += "&all_publishers=true";
    else if (to) url += "&publishers=" + encodeURIComponent(to);
    const res = await getJson(url, { method: "POST", headers: { Authorization: "Bearer " + t } });
    const targets = res && res.targets && res.targets[0];
    say("Replayed " + row.event_id + ": pending again" + (targets ? ", to " + (targets.join(", ") || "no publisher") : "") + ".", true);
    await refresh();
  } catch (e) {
    button.disabled = false;
    if (e.status === 401 && !retried) {
      sessionStorage.removeItem(TOKEN_KEY);
      return replay(row, button, true, to);
    }
    say("Replay of " + row.event_id + " failed: " + e.message, false);
  }
}

async function showTimeline(eventId) {
  try {
    const d = await getJson("/api/events/" + encodeURIComponent(eventId));
    $("#timeline-id").textContent = eventId;
    $("#timeline").replaceChildren(...d.timeline.map((t) => el("li", {},
      time(t.at_ms) + " ", el("span", { class: "kind kind-" + t.kind }, t.kind),
      t.attempt != null ? " · attempt " + t.attempt : "",
      t.publisher ? " · " + t.publisher : "",
      t.detail ? " · " + t.detail : "")));
    const archived = d.rows.filter((r) => r.archived);
    if (archived.length > 0) {
      $("#timeline").append(el("li", {}, el("span", { class: "kind kind-archived" }, "archived"),
        " · moved to the archive table (" + archived.map((r) => r.app_code).join(", ") + ")"));
    }
    const last = d.rows[d.rows.length - 1];
    if (last && last.last_error && !d.timeline.some((t) => t.detail === last.last_error)) {
      $("#timeline").append(el("li", {}, "last error: ", el("span", { class: "kind kind-failed" }, last.last_error)));
    }
    $("#timeline-section").hidden = false;
  } catch (e) {
    say("Cannot load " + eventId + ": " + e.message, false);
  }
}

// ---- search (`GET /api/events`, keyset pages) and bulk replay
// (`POST /api/replay`, after confirming the count of a dry run) ----

let searchNext = null;
// Each search's number: an answer to an older one (a search the page ran
// after a replay while the form was being changed) never replaces the
// results of a newer one.
let searchSeq = 0;

function searchFilter() {
  const f = new FormData($("#search"));
  const out = {};
  for (const k of ["app_code", "aggregate_id", "event_type", "status", "since", "until"]) {
    const v = (f.get(k) || "").trim();
    if (v) out[k] = v;
  }
  return { eventId: (f.get("event_id") || "").trim(), filter: out };
}

function resultRow(r) {
  return el("tr", { "data-event-id": r.event_id, onclick: () => showTimeline(r.event_id) },
    el("td", { class: "num" }, r.id), el("td", {}, r.app_code), el("td", {}, el("code", {}, r.event_id)),
    el("td", {}, r.event_type), el("td", { "data-status": r.status }, r.status),
    el("td", { class: "num" }, r.retry_count), el("td", {}, time(r.created_at_ms)),
    el("td", {}, r.archived ? "archived" : ""));
}

async function search(more) {
  const { eventId, filter } = searchFilter();
  const body = $("#results tbody");
  const seq = ++searchSeq;
  try {
    if (eventId) {
      const d = await getJson("/api/events/" + encodeURIComponent(eventId));
      if (seq !== searchSeq) return;
      body.replaceChildren(...d.rows.map(resultRow));
      searchNext = null;
    } else {
      const q = new URLSearchParams(Object.assign({ limit: "50" }, filter));
      if (more && searchNext != null) q.set("before_id", searchNext);
      const page = await getJson("/api/events?" + q);
      if (seq !== searchSeq) return;
      const rows = page.items.map(resultRow);
      if (more) body.append(...rows); else body.replaceChildren(...rows);
      searchNext = page.next;
    }
  } catch (e) {
    if (seq !== searchSeq) return;
    if (e.status === 404 && eventId) body.replaceChildren();
    else return say("Search failed: " + e.message, false);
  }
  $("#search-more").hidden = searchNext == null;
  $("#search-empty").hidden = body.children.length > 0;
}

async function replayMatching(button) {
  const { filter } = searchFilter();
  const said = Object.entries(filter).map(([k, v]) => k + " " + v).join(", ");
  if (!said) return say("Give a filter first (status, aggregate, event type, time): replaying every event is the command line's job.", false);
  try {
    const dry = await send("/api/replay", Object.assign({ dry_run: true }, filter));
    if (!dry) return;
    if (dry.count === 0) return say("No event matches " + said + ".", false);
    if (!window.confirm("Replay " + dry.count + " event" + (dry.count === 1 ? "" : "s") + " matching " + said + "?")) {
      return say("Replay cancelled.", false);
    }
    await operate("/api/replay", filter, button, "Replayed the events matching " + said + ": pending again.");
    await search(false);
  } catch (e) {
    say("Replay failed: " + e.message, false);
  }
}

$("#search").addEventListener("submit", (ev) => { ev.preventDefault(); search(false); });
$("#search-more").addEventListener("click", () => search(true));
$("#search-replay").addEventListener("click", (ev) => replayMatching(ev.target));

// ---- runtime controls (`GET/POST /api/controls`) ----

async function loadControls() {
  let d;
  try {
    d = await getJson("/api/controls");
  } catch (e) {
    if (e.status === 404) { $("#controls-section").remove(); return; }
    throw e;
  }
  $("#controls tbody").replaceChildren(...d.controls.map((c) => el("tr", {
    "data-app": c.app_code, "data-event-type": c.event_type,
  },
  el("td", {}, c.app_code), el("td", {}, c.event_type), el("td", { "data-paused": c.paused }, c.paused ? "paused" : ""),
  el("td", {}, c.delivery || ""), el("td", { class: "num" }, c.max_retry_count ?? ""),
  el("td", { class: "num" }, c.sample_percent != null ? c.sample_percent + " %" : ""),
  el("td", {}, c.updated_by + " · " + time(c.updated_at_ms)),
  el("td", {}, el("button", { class: "clear plain", type: "button",
    onclick: (ev) => operate("/api/controls", { app_code: c.app_code, event_type: c.event_type, clear: true },
      ev.target, "Cleared the control of " + c.app_code + "/" + c.event_type + ".") }, "Clear")))));
  $("#control-log").replaceChildren(...d.log.slice(0, 10).map((e) =>
    el("li", {}, time(e.at_ms) + " · " + e.by + " · " + e.app_code + "/" + e.event_type + ": " + e.change)));
}

$("#control-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const f = new FormData(ev.target);
  const body = { app_code: (f.get("app_code") || "*").trim(), event_type: (f.get("event_type") || "*").trim() };
  if (f.get("paused")) body.paused = f.get("paused") === "true";
  if (f.get("delivery")) body.delivery = f.get("delivery");
  const sample = (f.get("sample_percent") || "").trim();
  if (sample) body.sample_percent = sample === "default" ? "default" : Number(sample);
  const retries = (f.get("max_retry_count") || "").trim();
  if (retries) body.max_retry_count = retries === "default" ? "default" : Number(retries);
  operate("/api/controls", body, ev.submitter, "Control of " + body.app_code + "/" + body.event_type + " set.");
});

// ---- relays: their heartbeats in `<table>_relays`, read with the stats ----

async function loadRelays() {
  const active = Object.entries((await getJson("/api/publishers")).active_targets || {});
  $("#active-targets").hidden = active.length === 0;
  $("#active-targets").replaceChildren("Publishing through: ",
    ...active.map(([p, t], i) => el("span", { "data-publisher": p }, (i ? ", " : "") + p + " → " + t)));
  const r = await getJson("/api/relays");
  $("#relays tbody").replaceChildren(...r.relays.map((x) => el("tr", { "data-worker": x.worker_id },
    el("td", { "data-state": x.state }, x.state), el("td", {}, x.worker_id),
    el("td", {}, x.host + ":" + x.pid), el("td", {}, x.app_codes.join(", ")),
    el("td", {}, String(x.claimed)), el("td", {}, String(x.delivered)), el("td", {}, String(x.failed)),
    el("td", {}, String(x.per_minute)), el("td", {}, new Date(x.seen_at_ms).toLocaleString()))));
}

// ---- topology (`postbox serve`): read when the page opens and on Reload,
// never polled (it asks the brokers) ----

let topologyLoaded = false;

async function loadTopology() {
  topologyLoaded = true;
  let t;
  try {
    t = await getJson("/api/topology");
  } catch (e) {
    if (e.status === 404) { $("#topology-section").remove(); return; }
    $("#topology-notes").replaceChildren(el("li", { class: "error" }, "topology: " + e.message));
    return;
  }
  $("#topology tbody").replaceChildren(...t.routes.map((r) => el("tr", {
    "data-event-type": r.event_type, "data-publisher": r.publisher,
  },
  el("td", {}, r.event_type), el("td", {}, r.app_code), el("td", {}, r.publisher + " (" + r.kind + ")"),
  el("td", {}, r.target),
  el("td", { class: "takers" }, r.subscribers.length
    ? r.subscribers.map((s) => s.name + " (" + s.via + ", " + s.source + ")").join("; ")
    : (["rabbitmq", "nats", "redis"].includes(r.kind) ? "nobody known" : "—")))));
  $("#topology-notes").replaceChildren(
    ...t.idle_consumers.map((c) => el("li", {}, "consumer " + c + ": no route of the event types seen reaches it")),
    ...t.brokers.unreachable.map((u) => el("li", { class: "error" }, "not asked: " + u)));
}

$("#topology-reload").addEventListener("click", loadTopology);

// ---- consumers and their dead letters (`postbox consume`) ----

let openConsumer = null;
// The previous reading of each consumer's settled count, for its rate.
const lastSettled = new Map();

function rate(c) {
  const settled = c.ok + c.duplicate + c.stale + c.retry + c.held + c.dead;
  const now = Date.now();
  const before = lastSettled.get(c.name);
  lastSettled.set(c.name, { settled, at: now });
  if (!before || now <= before.at) return "—";
  return ((settled - before.settled) * 1000 / (now - before.at)).toFixed(1);
}

async function loadConsumers() {
  const d = await getJson("/api/consumers");
  $("#consumers-section").hidden = false;
  $("#consumers tbody").replaceChildren(...d.consumers.map((c) => el("tr", {
    "data-consumer": c.name, class: c.name === openConsumer ? "open" : "",
  },
  el("td", {}, c.name), el("td", {}, c.kind), el("td", {}, el("code", {}, c.queue)),
  el("td", { "data-state": c.state }, c.state), el("td", { class: "num" }, c.ok),
  el("td", { class: "num" }, c.retry), el("td", { class: "num" }, c.dead),
  el("td", { class: "num", "data-rate": "" }, rate(c)),
  el("td", {},
    el("button", {
      class: "switch", type: "button",
      onclick: (ev) => operate("/api/consumers/" + encodeURIComponent(c.name) + (c.state === "paused" ? "/resume" : "/pause"),
        null, ev.target, c.name + (c.state === "paused" ? " resumed." : " paused: it finishes the message in hand.")),
    }, c.state === "paused" ? "Resume" : "Pause"), " ",
    el("button", { class: "dead plain", type: "button", onclick: () => showDead(c.name) }, "Dead letters")))));
}

async function showDead(name) {
  openConsumer = name;
  const d = await getJson("/api/consumers/" + encodeURIComponent(name) + "/dead?limit=200");
  $("#dead-name").textContent = name;
  $("#dead-where").textContent = "(" + d.dead_letters + "; " +
    (d.complete ? d.matched + " letters)" : "the first " + d.letters.length + "; more follow)");
  $("#dead-empty").hidden = d.letters.length > 0;
  $("#dead tbody").replaceChildren(...d.letters.map((l) => el("tr", { "data-event-id": l.event_id || "" },
    el("td", { class: "num" }, l.position), el("td", {}, el("code", {}, l.event_id || "(none)")),
    el("td", {}, l.event_type), el("td", {}, l.dead_at_ms ? time(l.dead_at_ms) : "?"),
    el("td", { class: "num" }, l.attempts ?? "?"), el("td", { class: "error" }, l.last_error || ""),
    el("td", {}, ...(l.event_id ? [
      el("button", { class: "dead-replay", type: "button",
        onclick: (ev) => deadChange(name, "replay", { event_id: l.event_id }, ev.target) }, "Replay"), " ",
      el("button", { class: "dead-purge danger", type: "button",
        onclick: (ev) => deadChange(name, "purge", { event_id: l.event_id }, ev.target) }, "Purge"),
    ] : [])))));
  $("#dead-section").hidden = false;
}

// A replay or purge of the letters `filter` takes: counted by a dry run
// first, done once the operator confirmed that count.
async function deadChange(name, action, filter, button) {
  const url = "/api/consumers/" + encodeURIComponent(name) + "/dead/" + action;
  const what = filter.event_id ? "the dead letter of " + filter.event_id : "every dead letter";
  try {
    const dry = await send(url, Object.assign({ dry_run: true }, filter));
    if (!dry) return;
    if (dry.matched === 0) return say("Nothing to " + action + ": " + what + " is gone.", false);
    const verb = action === "replay" ? "Replay" : "Purge";
    if (!window.confirm(verb + " " + dry.matched + " dead letter" + (dry.matched === 1 ? "" : "s") + " of " + name + "?")) {
      return say(verb + " cancelled.", false);
    }
    await operate(url, filter, button, verb + "ed " + what + " of " + name + ".");
    await showDead(name);
  } catch (e) {
    say(action + " of " + what + " failed: " + e.message, false);
  }
}

// POST `url` with `body` as the operator; asks for the token once.
async function send(url, body, retried) {
  const t = token(retried);
  if (!t) { say("Cancelled: no token given.", false); return null; }
  try {
    return await getJson(url, {
      method: "POST",
      headers: { Authorization: "Bearer " + t, "Content-Type": "application/json" },
      body: body ? JSON.stringify(body) : undefined,
    });
  } catch (e) {
    if (e.status === 401 && !retried) {
      sessionStorage.removeItem(TOKEN_KEY);
      return send(url, body, true);
    }
    throw e;
  }
}

async function operate(url, body, button, done) {
  if (button) button.disabled = true;
  try {
    const res = await send(url, body);
    if (res) say(done + (res.done != null ? " (" + res.done + ")" : res.count != null ? " (" + res.count + ")" : ""), true);
    await refresh();
  } catch (e) {
    say("Failed: " + e.message, false);
  } finally {
    if (button) button.disabled = false;
  }
}

$("#dead-replay-all").addEventListener("click", (ev) => deadChange(openConsumer, "replay", { all: true }, ev.target));
$("#dead-purge-all").addEventListener("click", (ev) => deadChange(openConsumer, "purge", { all: true }, ev.target));
$("#dead-reload").addEventListener("click", () => showDead(openConsumer));

// Which parts this process serves: unknown (null) until first asked.
let servesOutbox = null;
let servesConsumers = null;

// One round of requests at a time. Against a slow server the timer fired
// every REFRESH_MS whatever the rounds still waiting, and they piled up,
// each holding connections of the relay's pool. A refresh asked for while
// a round runs (after a replay) runs once more after it, so that it shows
// what the change did.
let round = null;
let again = false;
function refresh() {
  if (round) {
    again = true;
    return round;
  }
  round = (async () => {
    do {
      again = false;
      await refreshRound();
    } while (again);
  })().finally(() => {
    round = null;
  });
  return round;
}

async function refreshRound() {
  let reached = false;
  let failure = null;
  if (servesOutbox !== false) {
    try {
      renderStats(await getJson("/api/stats"));
      servesOutbox = true;
      reached = true;
      for (const s of document.querySelectorAll("section.outbox")) s.hidden = false;
      await loadPublishers();
      await loadFailed();
      await loadControls();
      await loadRelays();
      if (!topologyLoaded) await loadTopology();
    } catch (e) {
      if (e.status === 404) servesOutbox = false;
      else failure = e;
    }
  }
  if (servesConsumers !== false) {
    try {
      await loadConsumers();
      servesConsumers = true;
      reached = true;
    } catch (e) {
      if (e.status === 404) servesConsumers = false;
      else failure = failure || e;
    }
  }
  const upd = $("#updated");
  if (failure) {
    upd.textContent = "admin server unreachable: " + failure.message;
    upd.classList.add("stale");
  } else if (reached && servesOutbox !== true) {
    upd.textContent = "updated " + time(Date.now());
    upd.classList.remove("stale");
  }
}

refresh();
setInterval(() => {
  if (!round) refresh();
}, REFRESH_MS);
