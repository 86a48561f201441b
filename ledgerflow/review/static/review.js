// The reviewer page's one script: it signs decisions in this browser with the approver's own Ed25519 key
// and posts them to the server, which only relays them to the task's workflow. The private key is imported
// once from the approver's key file as a non-extractable CryptoKey and kept in IndexedDB: nothing, not even
// this script, can read its bytes back, and no server ever holds it.
"use strict";

const DB_NAME = "ledgerflow-review";
const KEYS = "keys"; // records {approver, key_id, public_key, key: CryptoKey}, one per approver

function idb(mode, work) {
  return new Promise((resolve, reject) => {
    const open = indexedDB.open(DB_NAME, 1);
    open.onupgradeneeded = () => open.result.createObjectStore(KEYS, { keyPath: "approver" });
    open.onerror = () => reject(open.error);
    open.onsuccess = () => {
      const tx = open.result.transaction(KEYS, mode);
      const req = work(tx.objectStore(KEYS));
      tx.oncomplete = () => { open.result.close(); resolve(req.result); };
      tx.onerror = () => { open.result.close(); reject(tx.error); };
    };
  });
}

const storedKey = (approver) => idb("readonly", (s) => s.get(approver));
const storeKey = (record) => idb("readwrite", (s) => s.put(record));
const forgetKey = (approver) => idb("readwrite", (s) => s.delete(approver));

// The signed message: must stay byte for byte equal to canonical() in rules/people.py (the worker verifies
// against that). A version line, then one field per line; the note (the only field that may hold newlines)
// comes last. v3: the time it was signed (this browser's clock, ISO 8601 UTC) before the note; the worker
// refuses a decision that reaches it outside a window of that time (a replay, or a clock far off).
function canonical(taskId, d) {
  return ["ledgerflow-decision-v3", taskId, d.decision_id, d.request_id, d.decision, d.approver, d.key_id,
    d.amount || "", d.scope || "", d.issued_at, d.note].join("\n");
}

// A change's signed message: byte for byte canonical_change() in rules/changes.py. Its fields (an edit's)
// are canonical JSON there: sorted keys, no spaces, every non-ASCII character escaped (\uXXXX), as Python's
// json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=True) writes them.
function canonicalJson(value) {
  if (value === null || value === undefined) return "";
  const keys = Object.keys(value).sort();
  const text = "{" + keys.map((k) => JSON.stringify(k) + ":" + JSON.stringify(value[k])).join(",") + "}";
  return text.replace(/[\u0080-\uffff]/g, (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"));
}

function canonicalChange(taskId, c) {
  return ["ledgerflow-change-v1", taskId, c.change_id, c.kind, c.node || "", canonicalJson(c.input),
    c.approver, c.key_id, c.issued_at, c.note].join("\n");
}

// One signing path for every change the page sends (an edit, a waiver, a restore, a pause, a resume, a skip, a
// re-route): c is {kind, node, input, note}; the rest is this browser's key and clock.
async function signChange(taskId, c, record) {
  const change = {
    change_id: crypto.randomUUID(),
    kind: c.kind,
    node: c.node || null,
    input: c.input ?? null,
    approver: record.approver,
    key_id: record.key_id,
    note: c.note || "",
    issued_at: new Date().toISOString(),
  };
  const message = new TextEncoder().encode(canonicalChange(taskId, change));
  change.signature = hex(await crypto.subtle.sign({ name: "Ed25519" }, record.key, message));
  return change;
}

// What a change form asks for, read from the form: {kind, node, input, note}. Throws an Error with a message
// for a person when something it needs is missing.
function changeOf(form) {
  const fields = form.elements;
  const note = fields.note ? fields.note.value : "";
  const kind = form.dataset.kind || fields.kind.value;
  const named = () => {
    const node = (fields.node ? fields.node.value : form.dataset.node || "").trim();
    if (!node) throw new Error(`name the node to ${kind === "reroute" ? "send elsewhere" : kind}`);
    return node;
  };
  switch (kind) {
    case "edit": {
      const input = {};
      for (const area of form.querySelectorAll('textarea[name="field"]')) input[area.dataset.field] = area.value;
      return { kind, node: form.dataset.node, input, note };
    }
    case "waive":
      if (!note.trim()) throw new Error("say why the findings are waived (the reason is required)");
      return { kind, node: named(), input: null, note };
    case "restore": {
      const chosen = form.querySelector('input[name="version"]:checked');
      if (!chosen) throw new Error("choose the version to make current");
      return { kind, node: form.dataset.node, input: { version: Number(chosen.value) }, note };
    }
    case "skip":
      return { kind, node: named(), input: null, note };
    case "reroute": {
      const route = fields.route.value.trim();
      if (!route) throw new Error("name the route to send it to");
      return { kind, node: named(), input: { route }, note };
    }
    default: // pause, resume: the task's own
      return { kind, node: null, input: null, note };
  }
}

const hex = (buffer) => Array.from(new Uint8Array(buffer), (b) => b.toString(16).padStart(2, "0")).join("");

// An approver's key file (runtime/signing.py) -> a stored record. Throws an Error with a message for a person.
async function importKeyFile(file, approver) {
  let data;
  try {
    data = JSON.parse(await file.text());
  } catch {
    throw new Error(`${file.name} is not a key file (not JSON)`);
  }
  if (!data || data.ledgerflow_key !== 1 || typeof data.key_id !== "string" || typeof data.private_key !== "string") {
    throw new Error(`${file.name} is not a ledgerflow key file`);
  }
  if (data.approver !== approver) {
    throw new Error(`${file.name} is ${data.approver}'s key; you are signed in as ${approver}`);
  }
  let der;
  try {
    der = Uint8Array.from(atob(data.private_key), (c) => c.charCodeAt(0));
  } catch {
    throw new Error(`${file.name}: private_key is not base64`);
  }
  let key;
  try {
    key = await crypto.subtle.importKey("pkcs8", der, { name: "Ed25519" }, false, ["sign"]);
  } catch (e) {
    throw new Error(`${file.name}: private_key is not an Ed25519 PKCS#8 key (${e.message})`);
  }
  const record = { approver, key_id: data.key_id, public_key: data.public_key || "", key };
  await storeKey(record);
  return record;
}

// One signing path for every decision the page sends (a request's own form, or each member of a group of dead
// letters): d is {request_id, decision, note, amount, scope}; the rest is this browser's key and clock.
async function signDecision(taskId, d, record) {
  const signed = {
    decision_id: crypto.randomUUID(),
    request_id: d.request_id,
    decision: d.decision,
    approver: record.approver,
    key_id: record.key_id,
    note: d.note || "",
    amount: d.amount ?? null,
    scope: d.scope ?? null,
    issued_at: new Date().toISOString(),
  };
  const message = new TextEncoder().encode(canonical(taskId, signed));
  signed.signature = hex(await crypto.subtle.sign({ name: "Ed25519" }, record.key, message));
  return signed;
}

// The request page's decision form, signed. Throws an Error with a message for a person on a bad amount.
async function sign(taskId, form, record) {
  const fields = form.elements;
  const decision = fields.decision.value;
  const budget = decision === "add_budget";
  const amount = budget ? fields.amount.value.trim() : null;
  if (budget && !/^[0-9]{1,12}(\.[0-9]{1,12})?$/.test(amount)) {
    throw new Error("the amount must be a positive decimal number, like 2.5");
  }
  const scope = budget ? fields.scope.value : null;
  return signDecision(taskId, { request_id: form.dataset.requestId, decision, note: fields.note.value, amount, scope }, record);
}

async function send(taskId, payload, what = "decisions") {
  const root = document.body.dataset.root;
  const response = await fetch(`${root}/api/${what}/${encodeURIComponent(taskId)}`, {
    method: "POST",
    credentials: "same-origin",
    headers: {
      "Content-Type": "application/json",
      "X-CSRF-Token": document.querySelector('meta[name="csrf-token"]').content,
    },
    body: JSON.stringify(payload),
  });
  const body = await response.json().catch(() => ({ error: `the server answered ${response.status}` }));
  return { ok: response.ok, status: response.status, retryAfter: Number(response.headers.get("Retry-After")), body };
}

function show(status, text) {
  const outcome = document.getElementById("outcome");
  outcome.className = status.replace(/ /g, "-");
  outcome.textContent = text;
}

// The deadline in the reader's own time zone, and how far off it is ("in 9 min").
function showDeadline() {
  const el = document.getElementById("deadline");
  if (!el) return;
  const at = new Date(el.getAttribute("datetime"));
  if (Number.isNaN(at.getTime())) return;
  const minutes = Math.round((at.getTime() - Date.now()) / 60000);
  const span = Math.abs(minutes) < 120 ? `${Math.abs(minutes)} min` : `${Math.round(Math.abs(minutes) / 60)} h`;
  const when = minutes >= 0 ? `in ${span}` : `${span} ago`;
  el.title = el.getAttribute("datetime");
  el.textContent = `${at.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "short" })} (${when})`;
}

// Every other time on the page in the reader's own time zone (the recorded UTC instant on hover).
function showTimes() {
  for (const el of document.querySelectorAll("time.local")) {
    const at = new Date(el.getAttribute("datetime"));
    if (Number.isNaN(at.getTime())) continue;
    el.title = el.getAttribute("datetime");
    el.textContent = at.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "medium" });
  }
}

// Text artifacts (a storyboard, a script, a JSON answer) shown in the page as text — never as HTML — when
// their bytes are UTF-8 text; JSON is indented. Anything else stays a download.
async function showTexts() {
  for (const pre of document.querySelectorAll("pre.text-artifact")) {
    try {
      const response = await fetch(pre.dataset.src, { credentials: "same-origin" });
      if (!response.ok) throw new Error(`the server answered ${response.status}`);
      const text = new TextDecoder("utf-8", { fatal: true }).decode(await response.arrayBuffer());
      if (text.includes("\u0000")) throw new Error("not text");
      let shown = text;
      try {
        shown = JSON.stringify(JSON.parse(text), null, 2);
      } catch {
        // not JSON: shown as it is
      }
      pre.textContent = shown;
    } catch (e) {
      pre.textContent = `(not shown here: ${e.message === "not text" || e instanceof TypeError ? "not text" : e.message}; use the link to download it)`;
    }
  }
}

async function setUp() {
  showDeadline();
  showTimes();
  showTexts();
  if (!document.getElementById("key")) return; // the task has ended, or no group to resume: nothing to sign
  const form = document.getElementById("decide");
  const changes = Array.from(document.querySelectorAll("form.change"));
  const groups = Array.from(document.querySelectorAll("form.group"));
  const buttons = [form, ...changes, ...groups].filter(Boolean).map((f) => f.querySelector("button")).filter(Boolean);
  const key = await setUpKey(buttons);
  if (!key) return;
  const taskId = (form || changes[0])?.dataset.taskId;
  if (form) setUpDecision(taskId, form, key);
  for (const change of changes) setUpChange(taskId, change, key);
  for (const g of groups) setUpGroup(g, key);
}

// The key section (#key): the approver's key found in IndexedDB, or loaded from their key file, or forgotten.
// Enables ``buttons`` (those not spent, data-done) while a key is there. Returns the getter of the current
// key record, or null when this browser cannot sign at all.
async function setUpKey(buttons) {
  const approver = document.body.dataset.approver;
  const status = document.getElementById("key-status");
  const load = document.getElementById("key-load");
  const forget = document.getElementById("key-forget");
  let record = null;

  const ready = (r) => {
    record = r;
    status.textContent = r ? `Signing as ${r.approver} with key ${r.key_id} (kept in this browser).`
      : "No key in this browser yet: choose your key file.";
    load.hidden = Boolean(r);
    forget.hidden = !r;
    for (const b of buttons) if (!b.dataset.done) b.disabled = !r;
  };

  if (!window.crypto?.subtle || !window.indexedDB) {
    status.textContent = "This browser cannot sign here (it needs WebCrypto Ed25519 and IndexedDB over HTTPS or localhost).";
    return null;
  }
  try {
    ready((await storedKey(approver)) || null);
  } catch (e) {
    ready(null);
    show("rejected", `cannot read the stored key: ${e.message}`);
  }

  document.getElementById("key-file").addEventListener("change", async (event) => {
    const file = event.target.files[0];
    if (!file) return;
    try {
      ready(await importKeyFile(file, approver));
      show("loaded", `key ${record.key_id} loaded`);
    } catch (e) {
      show("rejected", e.message);
    } finally {
      event.target.value = "";
    }
  });
  forget.addEventListener("click", async () => {
    await forgetKey(approver);
    ready(null);
  });
  return () => record;
}

// The request page's decision form: signed with the stored key (sign) and sent to /api/decisions.
function setUpDecision(taskId, form, key) {
  const button = document.getElementById("sign");
  const budget = document.getElementById("budget");
  const toggle = () => { if (budget) budget.hidden = form.elements.decision.value !== "add_budget"; };
  form.addEventListener("change", toggle);
  toggle();

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const record = key();
    if (!record) return;
    button.disabled = true;
    let done = false;
    try {
      show("pending", "signing and sending… (waiting for the worker's ruling)");
      const { ok, body } = await send(taskId, await sign(taskId, form, record));
      if (!ok) {
        show("rejected", `not sent: ${body.error || "unknown error"}`);
      } else {
        show(body.status, body.line);
        done = body.status === "accepted" || body.status === "already resolved";
        if (done) document.getElementById("status").textContent = body.status === "accepted" ? body.detail : body.status;
      }
    } catch (e) {
      show("rejected", `not sent: ${e.message}`);
    } finally {
      button.disabled = done;
      if (done) button.dataset.done = "1";
    }
  });
}

// A group of dead letters that share a cause (the queue page): one resume per member, each signed with the
// stored key (signDecision) and sent to /api/decisions one after the other; each member's ruling is shown by
// it. A member accepted or already resolved is done; pressing the button again sends only the others. When the
// server says decisions come too fast (429), the page waits as long as it asks, then signs again.
function setUpGroup(form, key) {
  const button = form.querySelector("button");
  const members = Array.from(form.querySelectorAll("li[data-request-id]"));
  const mark = (li, status, text) => {
    const ruling = li.querySelector(".ruling");
    ruling.className = `ruling ${status.replace(/ /g, "-")}`;
    ruling.textContent = text;
  };
  const sendOne = async (li, record, note) => {
    const taskId = li.dataset.taskId;
    for (let tries = 0; ; tries++) {
      const signed = await signDecision(taskId, { request_id: li.dataset.requestId, decision: "resume", note }, record);
      const { ok, status, retryAfter, body } = await send(taskId, signed);
      if (status === 429 && tries < 5) {
        const seconds = retryAfter > 0 ? retryAfter : 6;
        mark(li, "pending", `waiting ${seconds} s: the server limits how fast one person's decisions arrive`);
        await new Promise((resolve) => setTimeout(resolve, seconds * 1000));
        continue;
      }
      return ok ? body : { status: "rejected", line: `not sent: ${body.error || "unknown error"}` };
    }
  };

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const record = key();
    if (!record) return;
    const todo = members.filter((li) => !li.dataset.done);
    const note = form.elements.note.value;
    button.disabled = true;
    const tally = {};
    for (const li of todo) {
      mark(li, "pending", "signing and sending… (waiting for the worker's ruling)");
      let ruled;
      try {
        ruled = await sendOne(li, record, note);
      } catch (e) {
        ruled = { status: "rejected", line: `not sent: ${e.message}` };
      }
      mark(li, ruled.status, ruled.line);
      if (ruled.status === "accepted" || ruled.status === "already resolved") li.dataset.done = "1";
      const word = ruled.status === "rejected" ? "refused or not sent" : ruled.status;
      tally[word] = (tally[word] || 0) + 1;
    }
    const left = members.filter((li) => !li.dataset.done).length;
    const summary = Object.entries(tally).map(([word, n]) => `${n} ${word}`).join(", ");
    show(left ? "rejected" : "accepted", `${todo.length} resume decision(s) sent: ${summary}`
      + (left ? `; ${left} not resolved yet (each says why)` : ""));
    if (left) {
      button.textContent = `Resume the ${left} left`;
    } else {
      button.dataset.done = "1";
    }
    button.disabled = !left;
  });
}

// A change form: signed with the stored key (signChange) and sent to /api/changes. A form that resolves the
// request (data-done: an edit, a waiver, a restore) is spent once accepted; the steering form stays usable (a
// pause, then a resume).
function setUpChange(taskId, form, key) {
  const button = form.querySelector("button");
  const steering = form.id === "steer";
  if (steering) {
    const toggle = () => {
      const kind = form.elements.kind.value;
      for (const label of form.querySelectorAll("label[data-for]")) {
        label.hidden = !label.dataset.for.split(" ").includes(kind);
      }
    };
    form.elements.kind.addEventListener("change", toggle);
    toggle();
  }
  if (form.id === "restore" && button) {
    form.addEventListener("change", () => {
      const chosen = form.querySelector('input[name="version"]:checked');
      if (chosen) button.textContent = `Make version ${chosen.value} current`;
    });
  }
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const record = key();
    if (!record || !button) return;
    button.disabled = true;
    let done = false;
    try {
      const c = changeOf(form);
      show("pending", `signing and sending… (waiting for the worker's ruling)`);
      const { ok, body } = await send(taskId, await signChange(taskId, c, record), "changes");
      if (!ok) {
        show("rejected", `not sent: ${body.error || "unknown error"}`);
      } else {
        show(body.status, body.line);
        if (body.status === "accepted") {
          if (steering) {
            afterSteer(form, c, record.approver);
          } else {
            done = true;
            document.getElementById("status").textContent = form.dataset.done;
          }
        }
      }
    } catch (e) {
      show("rejected", `not sent: ${e.message}`);
    } finally {
      button.disabled = done;
      if (done) button.dataset.done = "1";
    }
  });
}

// The steering form once a change was accepted: what the task is doing now, and the likely next step offered.
function afterSteer(form, c, approver) {
  const paused = document.getElementById("paused");
  if (c.kind === "pause") {
    paused.textContent = `Paused by ${approver}: nothing new starts until someone resumes it.`;
    form.elements.kind.value = "resume";
  } else if (c.kind === "resume") {
    paused.textContent = "Running: pausing it stops anything new from starting (work under way finishes).";
    form.elements.kind.value = "pause";
  }
  form.elements.kind.dispatchEvent(new Event("change"));
  form.elements.note.value = "";
}

document.addEventListener("DOMContentLoaded", setUp);
