// Build page: follow the live log (Server-Sent Events, or polling when the server refuses a stream).
// Cancel and retry are plain forms (with the session's CSRF token): they work without this script.
(function () {
  "use strict";
  var log = document.getElementById("log");
  var status = document.getElementById("log-status");
  var after = log ? parseInt(log.dataset.after || "0", 10) : 0;  // the server picked the tail's start
  var positions = log ? JSON.parse(log.dataset.positions || "{}") : {};

  // The compile wrote the line: each control character but tab (C0, DEL, C1; escape sequences lose their ESC) is
  // shown as \xNN text, as compilesvc/client/terminal_text.py does for the command line and the page.
  function visible(text) {
    return text.replace(/[\x00-\x08\x0b-\x1f\x7f-\x9f]/g, function (c) {
      return "\\x" + ("0" + c.charCodeAt(0).toString(16)).slice(-2);
    });
  }

  function append(entry) {
    var atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    var bucket = document.createElement("span");
    bucket.className = "bucket";
    bucket.textContent = "[" + (entry.bucket_key in positions ? positions[entry.bucket_key] : "?") + "] ";
    var span = document.createElement("span");
    span.className = "stream-" + entry.stream;
    span.textContent = visible(entry.line) + "\n";
    log.appendChild(bucket);
    log.appendChild(span);
    if (atBottom) { log.scrollTop = log.scrollHeight; }
    after = Math.max(after, entry.id);
  }

  function finished(state) {
    status.textContent = "build " + state + (log.childNodes.length ? "" : "; no log lines");
    var badge = document.getElementById("build-state");
    if (badge && badge.textContent !== state) { window.location.reload(); }
  }

  function poll() {
    // GET /logs?after=N: the same lines, for when streaming is refused or unavailable.
    fetch(log.dataset.poll + "?after=" + after).then(function (response) { return response.json(); })
      .then(function (page) {
        page.lines.forEach(append);
        if (page.finished) { finished(page.build_state); } else { setTimeout(poll, 2000); }
      }).catch(function () { setTimeout(poll, 5000); });
  }

  if (log && window.EventSource) {
    // EventSource resumes after the last event id by itself when the server closes a stream early.
    var source = new EventSource(log.dataset.stream + "?after=" + after);
    source.addEventListener("line", function (event) { append(JSON.parse(event.data)); status.textContent = "streaming…"; });
    source.addEventListener("end", function (event) { source.close(); finished(JSON.parse(event.data).state); });
    source.onopen = function () { status.textContent = "streaming…"; };
    source.onerror = function () {
      if (source.readyState === EventSource.CLOSED) {  // refused (e.g. 503): it will not retry by itself
        status.textContent = "polling…";
        poll();
      } else {
        status.textContent = "reconnecting…";
      }
    };
  } else if (log) {
    poll();
  }
})();
