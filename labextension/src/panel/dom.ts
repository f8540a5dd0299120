/**
 * The few DOM builders the side panel's views share.
 */

/** A div of `className` holding `text`. */
export function div(className: string, text = ''): HTMLDivElement {
  const node = document.createElement('div');
  node.className = className;
  node.textContent = text;
  return node;
}

/** A JupyterLab-styled button of `className`, labelled `label`, running `onClick`. */
export function button(className: string, label: string, onClick: () => void): HTMLButtonElement {
  const node = document.createElement('button');
  node.className = `jp-mod-styled ${className}`;
  node.textContent = label;
  node.onclick = onClick;
  return node;
}

/** A section header: its title, and a button at its right end. */
export function header(title: string, action: HTMLButtonElement): HTMLDivElement {
  const node = div('jp-ThemistoPanel-header', title);
  node.appendChild(action);
  return node;
}
