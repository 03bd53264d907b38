// Keys of the timeline's span search (dashboard/search.py): Enter in the search box goes to the
// next match (the box's own submit), Shift+Enter to the previous one (a click on its button).
// Taken on the document before the box sees it, so the box does not also submit.
(function () {
  "use strict";
  document.addEventListener("keydown", function (e) {
    if (e.key !== "Enter" || !e.shiftKey || !e.target || !e.target.closest) return;
    if (!e.target.closest("#search")) return;
    var prev = document.getElementById("search-prev");
    if (!prev) return;
    e.preventDefault();
    e.stopPropagation();
    prev.click();
  }, true);
})();
