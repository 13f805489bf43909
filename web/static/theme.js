/* The colour theme, set before the page is drawn (a classic script in <head>): the choice remembered in
   this browser, else the system's prefers-color-scheme. The top bar's button switches and remembers it;
   pages redraw their charts on the "themechange" event. */
(() => {
  const KEY = "anectypes.theme", root = document.documentElement;
  const system = matchMedia("(prefers-color-scheme: dark)");
  const apply = (theme) => {
    root.dataset.theme = theme;
    document.dispatchEvent(new Event("themechange"));
  };
  apply(localStorage.getItem(KEY) || (system.matches ? "dark" : "light"));
  system.addEventListener("change", (e) => { if (!localStorage.getItem(KEY)) apply(e.matches ? "dark" : "light"); });
  document.addEventListener("DOMContentLoaded", () => {
    const button = document.getElementById("theme-toggle");
    const label = () => button.setAttribute("aria-pressed", String(root.dataset.theme === "dark"));
    label();
    button.addEventListener("click", () => {
      const next = root.dataset.theme === "dark" ? "light" : "dark";
      localStorage.setItem(KEY, next);
      apply(next);
      label();
    });
  });
})();
