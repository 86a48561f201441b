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

async function signEdit(taskId, form, record) {
  const input = {};
  for (const area of form.querySelectorAll('textarea[name="field"]')) input[area.dataset.field] = area.value;
  const c = {
    change_id: crypto.randomUUID(),
    kind: "edit",
    node: form.dataset.node,
    input,
    approver: record.approver,
    key_id: record.key_id,
    note: form.elements.note.value,
    issued_at: new Date().toISOString(),
  };
  const message = new TextEncoder().encode(canonicalChange(taskId, c));
  c.signature = hex(await crypto.subtle.sign({ name: "Ed25519" }, record.key, message));
  return c;
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

async function sign(taskId, form, record) {
  const fields = form.elements;
  const decision = fields.decision.value;
  const budget = decision === "add_budget";
  const d = {
    decision_id: crypto.randomUUID(),
    request_id: form.dataset.requestId,
    decision,
    approver: record.approver,
    key_id: record.key_id,
    note: fields.note.value,
    amount: budget ? fields.amount.value.trim() : null,
    scope: budget ? fields.scope.value : null,
    issued_at: new Date().toISOString(),
  };
  if (budget && !/^[0-9]{1,12}(\.[0-9]{1,12})?$/.test(d.amount)) {
    throw new Error("the amount must be a positive decimal number, like 2.5");
  }
  const message = new TextEncoder().encode(canonical(taskId, d));
  d.signature = hex(await crypto.subtle.sign({ name: "Ed25519" }, record.key, message));
  return d;
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
  return { ok: response.ok, body };
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
  const form = document.getElementById("decide");
  if (!form) return;
  const approver = document.body.dataset.approver;
  const taskId = form.dataset.taskId;
  const status = document.getElementById("key-status");
  const load = document.getElementById("key-load");
  const forget = document.getElementById("key-forget");
  const button = document.getElementById("sign");
  let record = null;

  const edit = document.getElementById("edit");
  const editButton = document.getElementById("sign-edit");
  const ready = (r) => {
    record = r;
    status.textContent = r ? `Signing as ${r.approver} with key ${r.key_id} (kept in this browser).`
      : "No key in this browser yet: choose your key file.";
    load.hidden = Boolean(r);
    forget.hidden = !r;
    button.disabled = !r;
    if (editButton) editButton.disabled = !r;
  };

  if (!window.crypto?.subtle || !window.indexedDB) {
    status.textContent = "This browser cannot sign here (it needs WebCrypto Ed25519 and IndexedDB over HTTPS or localhost).";
    return;
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

  const budget = document.getElementById("budget");
  const toggle = () => { if (budget) budget.hidden = form.elements.decision.value !== "add_budget"; };
  form.addEventListener("change", toggle);
  toggle();

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
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
    }
  });

  if (edit) {
    edit.addEventListener("submit", async (event) => {
      event.preventDefault();
      if (!record) return;
      editButton.disabled = true;
      let done = false;
      try {
        show("pending", "signing and sending the edit… (waiting for the worker's ruling)");
        const { ok, body } = await send(taskId, await signEdit(taskId, edit, record), "changes");
        if (!ok) {
          show("rejected", `not sent: ${body.error || "unknown error"}`);
        } else {
          show(body.status, body.line);
          done = body.status === "accepted";
          if (done) document.getElementById("status").textContent = "resolved by your edit";
        }
      } catch (e) {
        show("rejected", `not sent: ${e.message}`);
      } finally {
        editButton.disabled = done;
      }
    });
  }
}

document.addEventListener("DOMContentLoaded", setUp);
