// lorafleet dashboard: copy buttons, tenant switcher, confirmations, and the upload form's
// drag-and-drop and progress bar. Plain JavaScript; every page also works without it.
(function () {
  "use strict";

  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
    // http:// on a LAN address has no async clipboard: fall back to a selected textarea.
    var area = document.createElement("textarea");
    area.value = text; document.body.appendChild(area); area.select();
    try { document.execCommand("copy"); } finally { document.body.removeChild(area); }
    return Promise.resolve();
  }

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy]");
    if (!button) return;
    var source = document.querySelector(button.getAttribute("data-copy"));
    if (!source) return;
    copyText(source.getAttribute("data-full") || source.textContent.trim()).then(function () {
      var label = button.textContent;
      button.textContent = "Copied"; button.classList.add("copied");
      setTimeout(function () { button.textContent = label; button.classList.remove("copied"); }, 1500);
    });
  });

  document.addEventListener("change", function (event) {
    if (event.target.matches("select[data-autosubmit]")) event.target.form.submit();
  });

  document.addEventListener("submit", function (event) {
    var message = event.target.getAttribute("data-confirm");
    if (message && !window.confirm(message)) event.preventDefault();
  });

  function formatBytes(n) {
    if (n >= 1e9) return (n / 1e9).toFixed(2) + " GB";
    if (n >= 1e6) return (n / 1e6).toFixed(1) + " MB";
    if (n >= 1e3) return (n / 1e3).toFixed(1) + " kB";
    return n + " B";
  }

  function setupUpload(form) {
    var config = form.querySelector("#id_config_file");
    var weights = form.querySelector("#id_weights_file");
    var zone = form.querySelector("#dropzone");
    var wrap = form.querySelector("#progress-wrap");
    var bar = form.querySelector("#upload-progress");
    var percent = form.querySelector("#upload-percent");
    var bytes = form.querySelector("#upload-bytes");
    var errorBox = form.querySelector("#upload-error");
    var result = form.querySelector("#upload-result");
    var button = form.querySelector("#upload-button");

    function clearErrors() {
      errorBox.hidden = true; errorBox.textContent = "";
      form.querySelectorAll("[data-error-for]").forEach(function (el) { el.textContent = ""; });
    }

    function showError(field, message) {
      errorBox.hidden = false;
      errorBox.innerHTML = "<strong>Upload refused.</strong> ";
      errorBox.appendChild(document.createTextNode(message));
      var key = field === "adapter_config.json" ? "config_file" : field === "adapter_model.safetensors" ? "weights_file" : field;
      var slot = form.querySelector('[data-error-for="' + key + '"]');
      if (!slot && /(lora_|\.weight|safetensors|tensor)/.test(field || "")) slot = form.querySelector('[data-error-for="weights_file"]');
      if (!slot && field) slot = form.querySelector('[data-error-for="config_file"]');
      if (slot) slot.textContent = message;
    }

    // Drag the two files of a PEFT folder onto the zone: each goes to the input it belongs to.
    function place(files) {
      var cfg = new DataTransfer(), wts = new DataTransfer(), placed = 0;
      Array.prototype.forEach.call(files, function (file) {
        if (/\.json$/i.test(file.name)) { cfg.items.add(file); placed++; }
        else if (/\.safetensors$/i.test(file.name)) { wts.items.add(file); placed++; }
      });
      if (cfg.files.length) config.files = cfg.files;
      if (wts.files.length) weights.files = wts.files;
      clearErrors();
      if (!placed) showError("", "Drop adapter_config.json and adapter_model.safetensors (PEFT format).");
    }
    ["dragenter", "dragover"].forEach(function (name) {
      zone.addEventListener(name, function (e) { e.preventDefault(); zone.classList.add("over"); });
    });
    ["dragleave", "drop"].forEach(function (name) {
      zone.addEventListener(name, function (e) { e.preventDefault(); zone.classList.remove("over"); });
    });
    zone.addEventListener("drop", function (e) { place(e.dataTransfer.files); });

    form.addEventListener("submit", function (event) {
      if (!window.XMLHttpRequest || !window.FormData) return;  // plain form post
      event.preventDefault();
      clearErrors(); result.hidden = true;
      var xhr = new XMLHttpRequest();
      xhr.open("POST", form.action || window.location.href);
      xhr.setRequestHeader("Accept", "application/json");
      // The CSRF token travels in a header too: a body over the size cap is cut off before its form
      // fields are read, and without the token Django would answer 403 instead of the real size error.
      var csrf = form.querySelector('input[name="csrfmiddlewaretoken"]');
      if (csrf) xhr.setRequestHeader("X-CSRFToken", csrf.value);
      wrap.hidden = false; bar.value = 0; percent.textContent = "0%"; button.disabled = true;
      xhr.upload.addEventListener("progress", function (e) {
        if (!e.lengthComputable) return;
        var p = Math.round(100 * e.loaded / e.total);
        bar.value = p; percent.textContent = p + "%";
        bytes.textContent = formatBytes(e.loaded) + " of " + formatBytes(e.total);
      });
      xhr.upload.addEventListener("load", function () {
        bar.value = 100; percent.textContent = "100%";
        bytes.textContent = "uploaded — validating…";
      });
      xhr.addEventListener("load", function () {
        button.disabled = false;
        var data = null;
        try { data = JSON.parse(xhr.responseText); } catch (e) { /* not JSON */ }
        if (xhr.status === 201 && data && data.ok) {
          bytes.textContent = "done";
          result.hidden = false;
          result.innerHTML = "";
          var strong = document.createElement("strong");
          strong.textContent = "Version " + data.number + " stored" + (data.live ? " and live" : "") + ". ";
          var sha = document.createElement("code");
          sha.id = "new-version-sha"; sha.textContent = data.sha256;
          var link = document.createElement("a");
          link.href = data.url; link.textContent = "See all versions →";
          result.append(strong, "sha256 ", sha, " ", link);
          result.setAttribute("data-number", data.number);
        } else if (data && data.error) {
          bytes.textContent = "";
          showError(data.field, data.error);
        } else {
          bytes.textContent = "";
          showError("", xhr.status === 413 ? "The files are larger than this server accepts." :
            xhr.status === 403 ? "The upload was refused (HTTP 403): your role may not upload versions, or your " +
              "session has expired — reload the page." : "The upload failed (HTTP " + xhr.status + "). Try again.");
        }
      });
      xhr.addEventListener("error", function () {
        button.disabled = false;
        showError("", "The connection broke during the upload. Try again.");
      });
      xhr.send(new FormData(form));
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("form[data-upload]").forEach(setupUpload);
  });
})();
