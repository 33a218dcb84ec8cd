// Filters of a trajectory page. The choice lives in the URL hash (#task=3&success=1), so a
// filtered view can be linked and survives a reload; an episode stays visible when its data
// attributes match every chosen value. The step selector opens another page, same filters.
(function () {
  "use strict";
  const FILTERS = ["task", "category", "success"];

  function apply() {
    const chosen = new URLSearchParams(location.hash.slice(1));
    for (const name of FILTERS) {
      document.getElementById("filter-" + name).value = chosen.get(name) || "";
    }
    let shown = 0;
    for (const episode of document.querySelectorAll("section.episode")) {
      const match = FILTERS.every(
          (name) => !chosen.get(name) || episode.dataset[name] === chosen.get(name));
      episode.hidden = !match;
      shown += match ? 1 : 0;
    }
    document.getElementById("shown").textContent = String(shown);
  }

  function choose() {
    const chosen = new URLSearchParams();
    for (const name of FILTERS) {
      const value = document.getElementById("filter-" + name).value;
      if (value) chosen.set(name, value);
    }
    location.hash = chosen.toString();
  }

  for (const name of FILTERS) {
    document.getElementById("filter-" + name).addEventListener("change", choose);
  }
  document.getElementById("step").addEventListener("change", (event) => {
    location.href = event.target.value + location.hash;
  });
  window.addEventListener("hashchange", apply);
  apply();
})();
