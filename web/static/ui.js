// Every page: keep the relative hints beside UTC times current ("5 min ago"), and on the history page
// refresh the rows of running builds in place (the same page, fetched again; nothing else on it moves).
(function () {
  "use strict";

  function span(seconds) {
    var s = Math.abs(seconds);
    if (s < 60) { return Math.floor(s) + " s"; }
    if (s < 3600) { return Math.floor(s / 60) + " min"; }
    if (s < 172800) { return Math.floor(s / 3600) + " h"; }
    return Math.floor(s / 86400) + " d";
  }

  function refreshHints(root) {
    var now = Date.now();
    (root || document).querySelectorAll(".ago[data-at]").forEach(function (el) {
      var seconds = (now - Date.parse(el.dataset.at)) / 1000;
      el.textContent = seconds < 0 ? "in " + span(seconds) : span(seconds) + " ago";
    });
  }

  // Every 3 s at first, slower the longer rows stay running (up to 30 s); not while the tab is hidden; and
  // never for a row the fresh page no longer has (it moved off this page): no tab polls for ever.
  var delay = 3000;
  function refreshRunningRows() {
    var running = Array.prototype.filter.call(document.querySelectorAll("tr[data-live]"),
                                              function (row) { return !row.dataset.gone; });
    if (!running.length) { return; }
    if (document.hidden) { setTimeout(refreshRunningRows, delay); return; }
    fetch(window.location.href, { headers: { "Accept": "text/html" }, credentials: "same-origin" })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html) {
          var fresh = new DOMParser().parseFromString(html, "text/html");
          running.forEach(function (row) {
            var replacement = fresh.getElementById(row.id);
            if (replacement) { row.replaceWith(document.importNode(replacement, true)); }
            else { row.dataset.gone = "1"; }
          });
          refreshHints();
        }
        delay = Math.min(delay * 1.25, 30000);
        setTimeout(refreshRunningRows, delay);
      })
      .catch(function () { setTimeout(refreshRunningRows, 30000); });
  }

  refreshHints();
  setInterval(refreshHints, 30000);
  if (document.querySelector("table.builds")) { setTimeout(refreshRunningRows, 3000); }
})();
